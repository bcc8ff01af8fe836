package nftables

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"time"

	"sigs.k8s.io/knftables"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Options configure a Backend.
type Options struct {
	// NFT returns the knftables interface of a family's table; nil runs the nft binary
	// (knftables.New), which must be 1.0.1 or newer.
	NFT func(fam policy.Family) (knftables.Interface, error)
	// Kernel reads the tables; nil reads them over netlink (NetlinkKernel).
	Kernel Kernel
	// Logger receives the backend's logs; nil discards them.
	Logger *slog.Logger
}

// NewNFT is the default Options.NFT: knftables on the nft binary.
func NewNFT(fam policy.Family) (knftables.Interface, error) {
	return knftables.New(nftFamily(fam), TableName)
}

// Backend is the nftables datapath (see the package comment for its layout).
//
// Apply, Cleanup and CheckDrift run on the agent's loop; Counters and Info may run at the same
// time (a metrics scrape), so what they share is guarded by mu.
type Backend struct {
	log    *slog.Logger
	newNFT func(fam policy.Family) (knftables.Interface, error)
	kernel Kernel
	// randomFully: the kernel accepts `masquerade fully-random` (probed by New).
	randomFully bool

	// Only the agent's loop uses these.
	nfts map[policy.Family]knftables.Interface
	// known is, per family, the table as this process last installed it, with the
	// fingerprints of its chains read right after; trusted while the ruleset's generation is
	// still gen (then nothing changed it).
	known    map[policy.Family]*knownTable
	gen      uint32
	genKnown bool
	// nextWalk is when CheckDrift may walk the sets' elements again, so that the walks take
	// a small share of the time whatever the sets hold.
	nextWalk time.Time
	// staleIPv6Checked is set once an Apply without IPv6 removed an IPv6 table an earlier run
	// with --enable-ipv6 left.
	staleIPv6Checked bool

	mu sync.Mutex
	// applied is, per family, what the last successful Apply installed, for Counters. A
	// published map is never modified.
	applied map[policy.Family]*appliedFamily
}

type knownTable struct {
	policy *policy.Policy
	in     *installed
	layout *Layout
	links  links
	// stale: a drift check found the sets' elements changed, so the next apply reads every
	// set whole rather than the known elements by key (see current).
	stale bool
}

type appliedFamily struct {
	policy *policy.Policy
	layout *Layout
}

var (
	_ datapath.Backend      = (*Backend)(nil)
	_ datapath.InfoReporter = (*Backend)(nil)
	_ datapath.DriftChecker = (*Backend)(nil)
)

// New returns a backend for the node: it checks that nft runs and that the kernel takes the
// table the backend installs (nat chains, fib, masquerade), with nft --check. It changes
// nothing.
func New(ctx context.Context, opts Options) (*Backend, error) {
	b := newBackend(opts)
	nft, err := b.nft(policy.IPv4)
	if err != nil {
		return nil, err
	}
	probe := &policy.Policy{IPv4: []policy.Rule{{Family: policy.IPv4, Prefix: policy.LinkLocalIPv4, Action: policy.Return,
		Origin: policy.OriginLinkLocal, Entry: -1}}, RandomFully: true}
	for _, rf := range []bool{true, false} {
		probe.RandomFully = rf
		tx := nft.NewTransaction()
		_, _, _ = update(tx, probe, NewLayout(probe, policy.IPv4), empty())
		if err = nft.Check(ctx, tx); err == nil {
			b.randomFully = rf
			break
		}
		if rf {
			b.log.Debug("nft --check refuses masquerade fully-random", "error", err)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("the kernel refuses the nftables table (nat chain, fib, masquerade): %w", err)
	}
	if !b.randomFully {
		b.log.Warn("the kernel rejects masquerade fully-random; masquerading without it")
	}
	if _, err := b.kernel.Generation(ctx); err != nil {
		return nil, err
	}
	return b, nil
}

// newBackend returns a backend that has probed nothing.
func newBackend(opts Options) *Backend {
	b := &Backend{log: opts.Logger, newNFT: opts.NFT, kernel: opts.Kernel,
		nfts: map[policy.Family]knftables.Interface{}, known: map[policy.Family]*knownTable{}}
	if b.log == nil {
		b.log = slog.New(slog.DiscardHandler)
	}
	b.log = b.log.With("component", "nftables")
	if b.newNFT == nil {
		b.newNFT = NewNFT
	}
	if b.kernel == nil {
		b.kernel = NetlinkKernel{}
	}
	return b
}

func (b *Backend) nft(fam policy.Family) (knftables.Interface, error) {
	if nft, ok := b.nfts[fam]; ok {
		return nft, nil
	}
	nft, err := b.newNFT(fam)
	if err != nil {
		return nil, fmt.Errorf("nftables (%s): %w (the nft command comes with the nftables package: apt-get install nftables)", nftFamily(fam), err)
	}
	b.nfts[fam] = nft
	return nft, nil
}

// Name implements datapath.Backend.
func (b *Backend) Name() string { return Name }

// Info implements datapath.InfoReporter: nftables attaches no programs.
func (b *Backend) Info() datapath.Info {
	return datapath.Info{Backend: Name, AttachMode: datapath.AttachNone, Details: info(b.appliedFamilies())}
}

func info(fams []policy.Family) string {
	if len(fams) == 0 {
		return "no table yet"
	}
	s := "table"
	for i, fam := range fams {
		if i > 0 {
			s += ","
		}
		s += " " + string(nftFamily(fam)) + " " + TableName
	}
	return s
}

func (b *Backend) appliedFamilies() []policy.Family {
	b.mu.Lock()
	applied := b.applied
	b.mu.Unlock()
	var out []policy.Family
	for _, fam := range policy.Families() {
		if applied[fam] != nil {
			out = append(out, fam)
		}
	}
	return out
}

// publish records what a family now holds (nil: nothing), for Counters, as soon as its
// transaction succeeded.
func (b *Backend) publish(fam policy.Family, a *appliedFamily) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.applied = datapath.Republished(b.applied, fam, a)
}

// Apply implements datapath.Backend: per family, the changes from the table as this process
// last installed it (while the ruleset's generation says nothing changed since), or else from
// the table as read from the kernel. Where the chains are the ones this process installed (or
// there is no table), the elements change in one netlink batch, between an nft transaction that
// prepares the chains and one that finishes them, each state deciding as the old policy or as
// the new (see phased); otherwise (another process's table, chains changed behind the agent's
// back, other masquerade rules) one nft transaction does it all. Elements that stay keep their
// counters. A change the kernel refuses (a table changed in a way the update did not foresee)
// is followed by one transaction that replaces the whole table, whose counters then restart.
func (b *Backend) Apply(ctx context.Context, p *policy.Policy) error {
	gen, err := b.kernel.Generation(ctx)
	trusted := err == nil && b.genKnown && gen == b.gen
	managed := []policy.Family{policy.IPv4}
	if p.Enabled(policy.IPv6) {
		managed = append(managed, policy.IPv6)
	} else if err := b.removeStaleIPv6(ctx); err != nil {
		b.log.Warn("could not remove a stale IPv6 table", "error", err)
	}
	b.genKnown = false
	for _, fam := range managed {
		fp := *p
		fp.RandomFully = p.RandomFully && b.randomFully
		if err := b.applyFamily(ctx, &fp, fam, trusted); err != nil {
			delete(b.known, fam)
			return err
		}
	}
	if gen, err := b.kernel.Generation(ctx); err == nil {
		b.gen, b.genKnown = gen, true
	}
	return nil
}

func (b *Backend) applyFamily(ctx context.Context, p *policy.Policy, fam policy.Family, trusted bool) error {
	nft, err := b.nft(fam)
	if err != nil {
		return err
	}
	known := b.known[fam]
	if trusted && known != nil && known.policy.Equal(p) {
		// Nothing changed the ruleset since this policy was installed.
		b.log.Debug("table unchanged; nothing to apply", "family", fam, "rules", len(p.Rules(fam)))
		return nil
	}
	l := NewLayout(p, fam)
	cur, read := (*installed)(nil), links{}
	if trusted && known != nil {
		cur, read = known.in, known.links
	} else if cur, read, err = b.current(ctx, fam, known, l); err != nil {
		return fmt.Errorf("apply %s: %w", nftFamily(fam), err)
	}
	// old is the layout the table's chains hold, nil when that is not known.
	var old *Layout
	switch {
	case !cur.table:
		old = &Layout{Family: fam, Outbound: -1}
	case known != nil && read.same(known.links):
		old = known.layout
	}
	start := time.Now()
	var st steps
	ok := old != nil
	if ok {
		st, ok = phased(nft, p, l, old, cur)
	}
	if ok {
		err = b.runSteps(ctx, nft, fam, st)
	} else {
		tx := nft.NewTransaction()
		st.want, st.added, st.deleted = update(tx, p, l, cur)
		err = nft.Run(ctx, tx)
	}
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("apply %s table %s: %w", nftFamily(fam), TableName, err)
		}
		b.log.Warn("the table could not be updated in place; replacing it (its counters restart)", "family", fam, "error", err)
		tx := nft.NewTransaction()
		st.want = replace(tx, p, l)
		if err := nft.Run(ctx, tx); err != nil {
			return fmt.Errorf("apply %s table %s: %w", nftFamily(fam), TableName, err)
		}
		ok, st.added, st.deleted = false, len(l.Elements), -1
	}
	b.log.Debug("table applied", "family", fam, "rules", len(p.Rules(fam)), "sets", len(l.Sets),
		"elementsAdded", st.added, "elementsDeleted", st.deleted, "overNetlink", ok, "took", time.Since(start))
	b.publish(fam, &appliedFamily{policy: p, layout: l})
	// The chains' fingerprints, to tell later whether someone changed them: cheap, the
	// elements are not read.
	back, err := b.kernel.Table(ctx, fam, false)
	if err != nil || back == nil {
		delete(b.known, fam)
		if err == nil {
			err = fmt.Errorf("the %s table is gone right after it was applied", nftFamily(fam))
		}
		b.log.Warn("cannot read the chains back; the next apply reads the whole table", "family", fam, "error", err)
		return nil
	}
	b.known[fam] = &knownTable{policy: p, in: st.want, layout: l, links: linksOf(back)}
	return nil
}

// current reads what a family's table holds and its chains. Where the chains and sets are
// those this process installed (known), only the elements it installed are read, by key: a set
// walked whole costs time quadratic in its elements, and on a node whose kube-proxy writes
// nftables the ruleset changes all the time. An element added behind the agent's back is then
// the drift check's walk to find, after which (stale) every set is read whole.
func (b *Backend) current(ctx context.Context, fam policy.Family, known *knownTable, l *Layout) (*installed, links, error) {
	st, err := b.kernel.Table(ctx, fam, false)
	switch {
	case err != nil:
		return nil, links{}, err
	case st == nil:
		return empty(), links{}, nil
	case known == nil || known.stale || !linksOf(st).same(known.links) || !sameSets(st, known.in, false):
		if st, err = b.kernel.Table(ctx, fam, true); err != nil || st == nil {
			return empty(), links{}, err
		}
		// What the walk missed of the elements to install, and of those installed.
		want := l.keys()
		if known != nil {
			for set, keys := range keysOf(known.in.elems) {
				want[set] = append(want[set], keys...)
			}
		}
		if err := completeWalk(ctx, b.kernel, fam, st, want); err != nil {
			return nil, links{}, err
		}
		return installedFrom(st), linksOf(st), nil
	}
	in := installedFrom(st)
	in.sets, in.elems = known.in.sets, make(map[string]map[netip.Addr]string, len(known.in.elems))
	for set, keys := range keysOf(known.in.elems) {
		got, err := b.kernel.Elements(ctx, fam, set, keys)
		if err != nil {
			return nil, links{}, err
		}
		m := make(map[netip.Addr]string, len(got))
		for k, e := range got {
			m[k] = e.Comment
		}
		in.elems[set] = m
	}
	return in, linksOf(st), nil
}

// runSteps runs an apply's steps (see phased). A step that fails leaves the table deciding as
// the old policy (before the batch) or the new one (after it).
func (b *Backend) runSteps(ctx context.Context, nft knftables.Interface, fam policy.Family, st steps) error {
	if st.prepare != nil {
		if err := nft.Run(ctx, st.prepare); err != nil {
			return fmt.Errorf("prepare the chains: %w", err)
		}
	}
	if len(st.elements) > 0 {
		if err := b.kernel.ChangeElements(ctx, fam, st.elements); err != nil {
			return err
		}
	}
	if st.finish != nil {
		if err := nft.Run(ctx, st.finish); err != nil {
			return fmt.Errorf("finish the chains: %w", err)
		}
	}
	return nil
}

func sameSNAT(a, b []SNATChain) bool {
	return slices.EqualFunc(a, b, func(x, y SNATChain) bool {
		return x.Name == y.Name && x.Address == y.Address && slices.Equal(x.Rules, y.Rules)
	})
}

func sameChains(a, b map[string][]string) bool {
	if a == nil || b == nil || len(a) != len(b) {
		return false
	}
	for name, rules := range a {
		if other, ok := b[name]; !ok || !slices.Equal(rules, other) {
			return false
		}
	}
	return true
}

// removeStaleIPv6 removes an IPv6 table left by an earlier run with --enable-ipv6 (looked for
// once) or by this process, so that no stale IPv6 policy stays in force unmanaged.
func (b *Backend) removeStaleIPv6(ctx context.Context) error {
	_, hadIPv6 := b.known[policy.IPv6]
	b.publish(policy.IPv6, nil)
	delete(b.known, policy.IPv6)
	if b.staleIPv6Checked && !hadIPv6 {
		return nil
	}
	st, err := b.kernel.Table(ctx, policy.IPv6, false)
	if err != nil {
		return err
	}
	b.staleIPv6Checked = true
	if st == nil {
		return nil
	}
	nft, err := b.nft(policy.IPv6)
	if err != nil {
		return err
	}
	b.log.Info("removing the IPv6 table of an earlier run with --enable-ipv6")
	return deleteTable(ctx, nft)
}

// deleteTable removes the interface's table; absent, it is created first, so that the
// deletion is valid either way (nft destroy needs nft 1.0.8 and kernel 6.3).
func deleteTable(ctx context.Context, nft knftables.Interface) error {
	tx := nft.NewTransaction()
	tx.Add(&knftables.Table{})
	tx.Delete(&knftables.Table{})
	return nft.Run(ctx, tx)
}

// Counters implements datapath.Backend: per rule, the sum of its elements' counters (an
// outbound rule's named counter), read from the kernel: the global lists' rules, then each
// source rule's. A rule with an element missing is left out; a rule that earlier rules cover
// entirely has no element and reports zero, and so do the rules of a source rule that decides
// no source of the family (its list is not installed).
func (b *Backend) Counters(ctx context.Context) ([]datapath.RuleCounter, error) {
	b.mu.Lock()
	applied := b.applied
	b.mu.Unlock()
	var out listCounters
	for _, fam := range policy.Families() {
		a := applied[fam]
		if a == nil {
			continue
		}
		st, err := b.kernel.Table(ctx, fam, false)
		if err != nil {
			return nil, err
		}
		if st != nil {
			// The layout's elements by key: a walk of every set takes time quadratic in its
			// elements, too long for a scrape, and misses some of a set being resized.
			for set, keys := range a.layout.keys() {
				if st.Sets[set] == nil {
					continue
				}
				if st.Sets[set].Elements, err = b.kernel.Elements(ctx, fam, set, keys); err != nil {
					return nil, err
				}
			}
		}
		c, _ := countRules(a.policy, a.layout, st)
		out.add(c)
	}
	return out.ordered(), nil
}

// Cleanup implements datapath.Backend: both tables are deleted (see Cleanup).
func (b *Backend) Cleanup(ctx context.Context) error {
	_, err := b.cleanup(ctx)
	return err
}

// Cleanup removes the agent's tables, whatever process installed them and with whatever
// flags, and returns the families ("ip", "ip6") it removed them from. It looks for them over
// netlink first, so a node without them needs no nft: nothing to remove is not an error. A
// kernel without IPv6 nftables has no IPv6 table.
func Cleanup(ctx context.Context, opts Options) ([]string, error) {
	return newBackend(opts).cleanup(ctx)
}

func (b *Backend) cleanup(ctx context.Context) ([]string, error) {
	var removed []string
	var errs []error
	for _, fam := range policy.Families() {
		delete(b.known, fam)
		b.publish(fam, nil)
		names, err := b.kernel.TableNames(ctx, fam)
		if err == nil && !slices.Contains(names, TableName) {
			continue
		}
		if err == nil {
			var nft knftables.Interface
			if nft, err = b.nft(fam); err == nil {
				err = deleteTable(ctx, nft)
			}
		}
		if err != nil {
			if fam == policy.IPv4 || ctx.Err() != nil {
				errs = append(errs, fmt.Errorf("clean up %s: %w", nftFamily(fam), err))
			} else {
				b.log.Warn("could not clean up", "family", fam, "error", err)
			}
			continue
		}
		removed = append(removed, string(nftFamily(fam)))
		b.log.Info("removed table", "family", fam, "table", TableName)
	}
	b.genKnown = false
	return removed, errors.Join(errs...)
}
