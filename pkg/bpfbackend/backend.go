// Package bpfbackend is the BPF datapath behind the agent's backend interface: it loads the SNAT
// engine (package bpf) with its maps pinned under <bpffs>/ip-masq-agent/v<layout>/ (migrating
// what an agent of an older layout pinned there, refusing a newer one's), attaches the programs
// to the uplinks (package tc), follows the uplinks and their addresses (package uplink), writes
// each policy into the maps and expires idle NAT entries. A Reader reads what it pinned from
// another process (`dump`); Cleanup removes everything it installed.
package bpfbackend

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/sandbox"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/uplink"
)

// Name is the backend's name on the command line.
const Name = "bpf"

// PinDir is the directory under the bpffs that holds the pins (the maps', in a directory per
// layout: bpf.LayoutDir), and LinkDir, under it, the tcx links' pins.
const (
	PinDir  = "ip-masq-agent"
	LinkDir = "links"
)

// Defaults of Options.
const (
	// DefaultSweepInterval keeps the NAT table close to its live flows: the shortest timeout
	// (ICMP, 30 s) is then overrun by a third at most.
	DefaultSweepInterval = 10 * time.Second
	// natEntriesNoIPv6 sizes the IPv6 NAT table when IPv6 is not enabled: the programs then
	// record no IPv6 flow, and LRU tables are preallocated (the default size is ~33 MB).
	natEntriesNoIPv6 = 1024
)

// Our tc filters (clsact mode): a fixed priority and handle, and the name prefix.
const (
	filterName     = "ip-masq-agent"
	filterPriority = 20000
	filterHandle   = 1
)

// Options configure a Backend.
type Options struct {
	// BPFFS is the mount point of a BPF filesystem (--bpffs).
	BPFFS string
	// Interfaces names the uplinks; empty means the devices of the default routes.
	Interfaces []string
	// EnableIPv6 sizes the IPv6 NAT table: small without it (see natEntriesNoIPv6).
	EnableIPv6 bool
	// AttachMode is tc.ModeTCX, tc.ModeTC, or "" / "auto" for the kernel's best (probed).
	AttachMode string
	// Load sizes the maps; PinPath is set by the backend. Zero values are the bpf defaults.
	Load bpf.LoadOptions
	// SweepInterval is how often idle NAT entries are removed; zero means the default.
	SweepInterval time.Duration
	// Timeouts are the idle timeouts of the sweep that --nat-timeouts sets: each one set
	// (nonzero) wins; the others are the node's own conntrack sysctls, read at every sweep, or
	// else conntrack's defaults (bpf.ResolveTimeouts).
	Timeouts bpf.Timeouts
	// ConntrackDir is where the node's conntrack sysctls are; empty means
	// bpf.ConntrackSysctlDir, those of the namespace the agent runs in.
	ConntrackDir string
	// Logger receives the backend's logs; nil discards them.
	Logger *slog.Logger
}

// Backend is the BPF datapath. Apply runs on the agent's loop; Counters, Info and the NAT
// reports may run at the same time (metric scrapes).
type Backend struct {
	opts Options
	// pinRoot is <bpffs>/ip-masq-agent, pinDir the maps' directory under it.
	pinRoot string
	pinDir  string
	mode    string
	log     *slog.Logger
	attach  *tc.Manager
	resolve *uplink.Resolver
	// watchRes is the watcher's resolver: Apply gives it the policy's scope too.
	watchRes *uplink.Resolver
	changes  chan string

	// dp is nil until the first Apply loads the datapath (a bad configuration at startup thus
	// leaves the node as it was).
	dp atomic.Pointer[bpf.Datapath]

	stop func()
	wg   sync.WaitGroup

	mu      sync.Mutex // guards what Apply publishes for Info
	uplinks []uplink.Uplink
	// draining are the former uplinks that keep the programs while their flows last (former.go).
	draining []former
	// unsupported are the devices without an Ethernet header that the last Apply found pod
	// traffic routed through (uplink.Set.Unsupported).
	unsupported []uplink.Uplink
	refused     string // why the last load refused the pins (datapath.Info.Refused)

	// watched is what the uplink watcher read when it last saw the uplinks change, until an
	// Apply uses it instead of reading them again.
	watched atomic.Pointer[uplink.Set]

	// Only the agent's loop uses these.
	//
	// missing are the --interfaces devices the last Apply did not find.
	missing []string
	// lastApplied is the policy of the last successful Apply (uplinks are the uplinks it
	// attached to); applied tells that the last Apply succeeded, so that the node holds both:
	// what CheckDrift compares with.
	lastApplied *policy.Policy
	applied     bool
	// migration is the migration from older layouts' pins whose first pass the load did, until
	// an Apply has swapped the programs everywhere and finished it.
	migration *bpf.Migration

	// hooks is what the drift checks found on each uplink's hooks (see checkHooks); guarded by
	// hookMu, as Hooks reads it for metric scrapes.
	hookMu sync.Mutex
	hooks  map[hookKey]*hookState
}

var (
	_ datapath.Backend      = (*Backend)(nil)
	_ datapath.InfoReporter = (*Backend)(nil)
	_ datapath.NATReporter  = (*Backend)(nil)
	_ datapath.Reader       = (*Backend)(nil)
	_ datapath.DriftChecker = (*Backend)(nil)
	_ datapath.HookReporter = (*Backend)(nil)
)

// New checks that the node can run the BPF datapath (a writable BPF filesystem, programs the
// kernel loads, a way to attach them), chooses the attach mode, and starts following the uplinks
// and sweeping the NAT table until ctx ends or Close. It installs nothing: the first Apply does.
func New(ctx context.Context, opts Options) (*Backend, error) {
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	log := opts.Logger.With("component", "bpf")
	if opts.SweepInterval <= 0 {
		opts.SweepInterval = DefaultSweepInterval
	}
	if err := CheckBPFFS(opts.BPFFS); err != nil {
		return nil, err
	}
	if err := probeLoad(); err != nil {
		return nil, err
	}
	mode := opts.AttachMode
	if err := tc.CheckMode(mode); err != nil {
		return nil, err
	}
	if mode == "" || mode == tc.ModeAuto {
		m, reason, err := tc.Probe()
		if err != nil {
			return nil, err
		}
		mode = m
		log.Info("attach mode chosen", "mode", mode, "reason", reason)
	} else {
		log.Info("attach mode chosen", "mode", mode, "reason", "--attach-mode")
	}
	pinRoot := filepath.Join(opts.BPFFS, PinDir)
	attach, err := tc.NewManager(mode, tcOptions(pinRoot, opts.Logger))
	if err != nil {
		return nil, err
	}
	res, err := uplink.NewResolver(opts.Interfaces)
	if err != nil {
		attach.Close()
		return nil, err
	}
	watchRes, err := uplink.NewResolver(opts.Interfaces)
	if err != nil {
		attach.Close()
		res.Close()
		return nil, err
	}
	b := &Backend{opts: opts, pinRoot: pinRoot, pinDir: bpf.LayoutDir(pinRoot), mode: mode, log: log,
		attach: attach, resolve: res, watchRes: watchRes, changes: make(chan string, 1)}
	ctx, cancel := context.WithCancel(ctx)
	b.stop = cancel
	b.wg.Add(2)
	go func() {
		defer b.wg.Done()
		defer watchRes.Close()
		uplink.Watch(ctx, watchRes, b.uplinksChanged, opts.Logger)
	}()
	go func() {
		defer b.wg.Done()
		b.sweepLoop(ctx)
	}()
	return b, nil
}

// AttachOptions are how the backend attaches its programs under bpffs, and knows them again
// (what an agent of any layout did): for tests that install an earlier agent's datapath.
func AttachOptions(bpffs string, log *slog.Logger) tc.Options {
	return tcOptions(filepath.Join(bpffs, PinDir), log)
}

// tcOptions identify our attachments, for the backend and for cleanup. The links are pinned
// under the pin root, outside the layout directories: an agent of any layout swaps the programs
// of the same links.
func tcOptions(pinRoot string, log *slog.Logger) tc.Options {
	return tc.Options{LinkDir: filepath.Join(pinRoot, LinkDir), FilterName: filterName,
		FilterPriority: filterPriority, FilterHandle: filterHandle, Owns: bpf.Owns, Logger: log}
}

// probeLoad loads the programs once with tiny maps, pinning nothing: the kernel must accept them.
func probeLoad() error {
	dp, err := bpf.Load(bpf.LoadOptions{MaxRules: 8, NATEntries: 64, NATEntriesV6: 64, FragEntries: 64})
	if err != nil {
		err = sandbox.ExplainBPF(err)
		if _, denied := errors.AsType[*sandbox.DeniedError](err); denied {
			return err // the kernel never saw the programs
		}
		return fmt.Errorf("the kernel does not load the BPF programs: %w", err)
	}
	return dp.Close()
}

// Name implements datapath.Backend.
func (b *Backend) Name() string { return Name }

// Changes carries uplink changes (an uplink appeared or went away, an address changed); each one
// should lead to an Apply, which installs the uplinks as the watcher last read them
// (agent.Options.Changes).
func (b *Backend) Changes() <-chan string { return b.changes }

// uplinksChanged is what the watcher calls with each change: the next Apply uses cur, and is
// asked for through Changes. While a reason waits there, later ones are dropped: the Apply it
// leads to uses the newest resolution anyway.
func (b *Backend) uplinksChanged(reason string, cur uplink.Set) {
	b.watched.Store(&cur)
	b.askApply(reason)
}

// askApply asks for an Apply through Changes, for reason.
func (b *Backend) askApply(reason string) {
	select {
	case b.changes <- reason:
	default:
	}
}

// Mode is the attach mode, tc.ModeTCX or tc.ModeTC.
func (b *Backend) Mode() string { return b.mode }

// Info implements datapath.InfoReporter.
func (b *Backend) Info() datapath.Info {
	b.mu.Lock()
	defer b.mu.Unlock()
	return datapath.Info{Backend: Name, AttachMode: b.mode, Details: details(b.pinDir, b.uplinks, b.draining), Refused: b.refused}
}

func details(pinDir string, ups []uplink.Uplink, draining []former) string {
	s := "maps pinned under " + pinDir
	if len(ups) > 0 {
		s += "; uplinks " + strings.Join(uplinkNames(ups), ", ")
	}
	if len(draining) > 0 {
		var names []string
		for _, f := range draining {
			names = append(names, f.String()+" "+f.note())
		}
		s += "; former uplinks draining " + strings.Join(names, ", ")
	}
	return s
}

func uplinkNames(ups []uplink.Uplink) []string {
	names := make([]string, len(ups))
	for i, u := range ups {
		names[i] = u.String()
	}
	return names
}

// Apply implements datapath.Backend: the policy into the maps (as a difference, new entries
// before stale ones are removed), then the uplinks' addresses, then the programs onto the
// uplinks (replacing an earlier process's in place), then what is left on devices that are no
// longer uplinks is removed, and then a migration from older pins is finished. Each step repairs
// drift: entries changed behind the agent's back are rewritten, programs detached behind its
// back are attached again.
func (b *Backend) Apply(ctx context.Context, p *policy.Policy) error {
	dp, err := b.datapathFor(p)
	if err != nil {
		return err
	}
	b.applied = false // until this apply succeeds
	if err := b.syncPolicy(dp, p); err != nil {
		return err
	}
	set, err := b.resolveUplinks(ctx, p)
	if err != nil {
		return err
	}
	ups := set.Uplinks
	b.mu.Lock()
	changed := !slices.Equal(b.uplinks, ups)
	b.mu.Unlock()
	if b.migration != nil {
		// The old programs still run: what they did during the migration's first pass goes in
		// right before the swap.
		if err := b.migration.CatchUp(dp); err != nil {
			return fmt.Errorf("migration: %w", err)
		}
	}
	held := heldAddrs(set)
	if err := b.install(ctx, dp, p, set, held, changed); err != nil {
		return err
	}
	if err := b.dropStale(ctx, dp, ups, held); err != nil {
		return err
	}
	if err := b.finishMigration(dp); err != nil {
		return err
	}
	b.lastApplied, b.applied = p, true
	b.mu.Lock()
	b.uplinks = ups
	b.mu.Unlock()
	if changed {
		b.log.Info("programs attached", "mode", b.mode, "uplinks", uplinkNames(ups))
	}
	return nil
}

// datapathFor returns the datapath, loaded by the first Apply, with rule maps that can hold p.
func (b *Backend) datapathFor(p *policy.Policy) (*bpf.Datapath, error) {
	dp := b.dp.Load()
	if dp == nil {
		var err error
		if dp, err = b.load(p, 0); err != nil {
			return nil, err
		}
		b.dp.Store(dp)
	}
	return b.ensureCapacity(dp, p)
}

// syncPolicy pins again the maps whose pins are gone, and writes p into the maps.
func (b *Backend) syncPolicy(dp *bpf.Datapath, p *policy.Policy) error {
	if repinned, err := dp.Repin(); err != nil {
		return err
	} else if len(repinned) > 0 {
		b.log.Warn("map pins were missing; pinned again", "maps", repinned)
	}
	// Re-applying the policy in force (a resync, a retry, a drift repair) first re-reads the
	// tries, so that entries changed behind the agent's back are written again. A new policy
	// (a config change) skips the re-read, which costs a syscall per entry: drift in between is
	// the drift check's to find, and its repair re-applies this policy.
	if p.Equal(b.lastApplied) {
		if err := dp.Refresh(); err != nil {
			return fmt.Errorf("read the maps: %w", err)
		}
	}
	return dp.SyncPolicy(p)
}

// resolveUplinks returns the uplinks under p: as the watcher read them when it last saw them
// change, if no Apply used that yet and p is the policy in force, else read now. Routes make
// uplinks where p may masquerade their destination. Having none is an error.
func (b *Backend) resolveUplinks(ctx context.Context, p *policy.Policy) (uplink.Set, error) {
	b.resolve.SetScope(p.MayMasquerade)
	b.watchRes.SetScope(p.MayMasquerade)
	set := b.watched.Swap(nil)
	if set == nil || !p.Equal(b.lastApplied) {
		cur, err := b.resolve.Resolve(ctx)
		if err != nil {
			return uplink.Set{}, err
		}
		set = &cur
	}
	if len(set.Missing) > 0 && !slices.Equal(set.Missing, b.missing) {
		b.log.Warn("uplinks named by --interfaces do not exist (yet); they are attached when they appear", "missing", set.Missing)
	}
	b.missing = set.Missing
	b.mu.Lock()
	was := b.unsupported
	b.unsupported = set.Unsupported
	b.mu.Unlock()
	if names := uplinkNames(set.Unsupported); len(names) > 0 && !slices.Equal(names, uplinkNames(was)) {
		b.log.Warn("devices that pod traffic leaves by have no Ethernet header, which the programs cannot parse: "+
			"pod traffic leaving by them is not masqueraded (use the iptables or nftables backend on such a node)",
			"devices", names)
	}
	if len(set.Uplinks) == 0 {
		if len(b.opts.Interfaces) > 0 && !strings.HasPrefix(b.opts.Interfaces[0], "!") {
			return uplink.Set{}, fmt.Errorf("no uplink: none of --interfaces %s exists", strings.Join(b.opts.Interfaces, ","))
		}
		return uplink.Set{}, errors.New("no uplink: no default route, and no route toward a masqueraded destination")
	}
	return *set, nil
}

// snatAddrs is what uplink_snat (and uplink_macs) hold for u under p: for each family, p's
// masquerade address when it has one, else u's own; IPv6 only where p masquerades IPv6. A
// masquerade address is thus every uplink's, as iptables' SNAT rule applies to every device
// (the agent checked it is one of the node's uplinks'), and host flows from it keep their ports
// as they do from an uplink's own address.
func snatAddrs(u uplink.Uplink, p *policy.Policy) bpf.Uplink {
	addrs := bpf.Uplink{IPv4: cmp.Or(p.MasqueradeAddress, u.IPv4), MAC: u.MAC}
	if p.Enabled(policy.IPv6) {
		addrs.IPv6 = cmp.Or(p.MasqueradeAddressIPv6, u.IPv6)
	}
	return addrs
}

// heldAddrs are the addresses of the uplinks of set: the flows translated to one of them are not
// flushed when another uplink stops using it.
func heldAddrs(set uplink.Set) []netip.Addr {
	var held []netip.Addr
	for _, addrs := range set.Addrs {
		held = append(held, addrs...)
	}
	return held
}

// install writes each uplink's SNAT addresses and attaches the programs to it. changed tells
// that the uplinks differ from the last Apply's: a missing address is then warned about. The
// flows of an SNAT address the policy no longer uses, but that is still one of the uplinks'
// (held: a masqueradeAddress changed), keep it, as conntrack's do; an address gone takes its
// flows.
func (b *Backend) install(ctx context.Context, dp *bpf.Datapath, p *policy.Policy, set uplink.Set, held []netip.Addr, changed bool) error {
	ups := set.Uplinks
	progs := tc.Programs{Egress: dp.Egress(), Ingress: dp.Ingress()}
	b.mu.Lock()
	attached := b.uplinks
	b.mu.Unlock()
	for _, u := range ups {
		if changed {
			b.warnNoAddress(u, p)
		}
		flushed, err := dp.SetUplinkHolding(u.Index, snatAddrs(u, p), held)
		if err != nil {
			return err
		}
		if flushed > 0 {
			b.log.Info("uplink address changed; flows of the old address flushed", "uplink", u.Name, "entries", flushed)
		}
		if err := b.attachTo(ctx, u, progs, slices.Contains(attached, u)); err != nil {
			return fmt.Errorf("attach to %s: %w", u.Name, err)
		}
	}
	return nil
}

// attachTo makes the uplink run the programs. One that the last successful Apply attached to
// (before) and that still runs them, pins included, is left alone after that check (a query
// per hook: no netlink in tcx mode): attaching again would also look for what the other attach
// mode left on the device, which only an earlier process can have left and which that Apply
// removed. In tcx mode this spares every uplink four netlink requests per apply.
func (b *Backend) attachTo(ctx context.Context, u uplink.Uplink, progs tc.Programs, before bool) error {
	if before {
		st, err := b.attach.Check(ctx, u.Index, progs)
		if err == nil && st.Runs && st.Pinned {
			return nil
		}
	}
	return b.attach.Attach(ctx, u.Index, progs)
}

// warnNoAddress warns when an uplink lacks the address of a family it is expected to carry: a
// device named by --interfaces either family, one found by its routes the families of its
// routes.
func (b *Backend) warnNoAddress(u uplink.Uplink, p *policy.Policy) {
	named, snat := u.Via == uplink.ViaInterfaces, snatAddrs(u, p)
	if (named || u.RoutedV4) && !snat.IPv4.IsValid() {
		b.log.Warn("uplink has no IPv4 address: its masqueraded IPv4 traffic is dropped", "uplink", u.Name)
	}
	if p.Enabled(policy.IPv6) && (named || u.RoutedV6) && !snat.IPv6.IsValid() {
		b.log.Warn("uplink has no global IPv6 address: its masqueraded IPv6 traffic is dropped", "uplink", u.Name)
	}
}

// dropStale removes our programs and SNAT addresses from devices that are not uplinks any more:
// the devices uplink_snat holds (every device the programs were attached to got an entry there)
// and those with a tcx link pin. Other devices are not looked at, so an apply costs the same on
// a node with thousands of pod devices; cleanup looks at them all. A former uplink whose flows
// still use it drains instead (former.go): it keeps the programs, attached again if they went,
// and the SNAT addresses still on it. The flows of an address another uplink still has (held)
// are never flushed.
func (b *Backend) dropStale(ctx context.Context, dp *bpf.Datapath, ups []uplink.Uplink, held []netip.Addr) error {
	snat, err := dp.Uplinks()
	if err != nil {
		return err
	}
	pinned, err := b.attach.Pinned()
	if err != nil {
		return err
	}
	b.mu.Lock()
	was := b.draining
	b.mu.Unlock()
	var draining []former // stored once all are seen: on an error, the former uplinks stay listed
	progs := tc.Programs{Egress: dp.Egress(), Ingress: dp.Ingress()}
	for _, i := range slices.Compact(slices.Sorted(slices.Values(append(slices.Collect(maps.Keys(snat)), pinned...)))) {
		if slices.ContainsFunc(ups, func(u uplink.Uplink) bool { return u.Index == i }) {
			continue
		}
		cur, ok := snat[i]
		f, why, err := assessFormer(ctx, dp, b.resolve, i, cur, ok)
		if err != nil {
			return err
		}
		before := slices.ContainsFunc(was, func(w former) bool { return w.Index == i })
		if why == "" {
			if _, err := dp.SetUplinkHolding(i, f.snatOf(), held); err != nil {
				return err
			}
			if err := b.attachTo(ctx, f.Uplink, progs, true); err != nil {
				return fmt.Errorf("attach to %s: %w", f.Name, err)
			}
			draining = append(draining, f)
			if !before {
				b.log.Info("a former uplink drains: it keeps the programs while flows masqueraded out of it last, as conntrack keeps their bindings",
					"uplink", f.String(), "flows", f.flows)
			}
			continue
		}
		if err := b.attach.Detach(ctx, i); err != nil {
			return err
		}
		n, err := dp.RemoveUplinkHolding(i, held)
		if err != nil {
			return err
		}
		b.log.Info("a former uplink is left: programs detached, its flows flushed", "uplink", f.Name, "ifindex", i,
			"why", why, "flushedEntries", n)
	}
	b.mu.Lock()
	b.draining = draining
	b.mu.Unlock()
	return nil
}

// checkDraining, after a sweep, asks for an apply when a former uplink that drains is to go: its
// flows are over, or its device or address went (which the uplink watcher does not follow, the
// device being no uplink).
func (b *Backend) checkDraining(ctx context.Context, dp *bpf.Datapath) {
	b.mu.Lock()
	draining := b.draining
	b.mu.Unlock()
	if len(draining) == 0 {
		return
	}
	res, err := uplink.NewResolver(nil)
	if err != nil {
		b.log.Warn("cannot check the former uplinks", "error", err)
		return
	}
	defer res.Close()
	for _, f := range draining {
		why, err := func() (string, error) {
			cur, ok, err := dp.Uplink(f.Index)
			if err != nil {
				return "", err
			}
			_, why, err := assessFormer(ctx, dp, res, f.Index, cur, ok)
			return why, err
		}()
		if err != nil {
			b.log.Warn("cannot check a former uplink", "uplink", f.Name, "error", err)
			continue
		}
		if why != "" {
			b.askApply("former uplink " + f.Name + ": " + why)
			return
		}
	}
}

// load loads the datapath over what is pinned: the maps of this build's layout (bpf.LayoutDir)
// are reused, and the entries of older layouts' pins are migrated into them (the first pass;
// finishMigration does the rest once the programs are swapped). Pins of a layout this agent does
// not know are refused, before anything is touched: they may be a newer agent's. Pinned maps of
// this layout but other sizes (the NAT tables after --nat-max-entries or --enable-ipv6 changed)
// are replaced, and only they: the flow state's are set aside and migrated into the new ones,
// as an older layout's are (every flow keeps its mapping); the policy's are written again, and
// the rule counters start over unless a policy that outgrew them carries them (ensureCapacity).
// The programs still attached keep using the old maps until Apply replaces them, so traffic
// never meets empty maps.
//
// maxRules sizes the rule maps; 0 keeps the pinned maps' size, or makes room for p when nothing
// is pinned (a larger policy later grows them: see ensureCapacity).
func (b *Backend) load(p *policy.Policy, maxRules uint32) (*bpf.Datapath, error) {
	pins, err := b.inspect()
	if err != nil {
		return nil, err
	}
	migrate := len(pins.Sources) > 0 && b.migration == nil
	lopts := b.opts.Load
	lopts.PinPath = b.pinDir
	if maxRules == 0 && lopts.MaxRules == 0 {
		dirs := []string{b.pinDir}
		for _, src := range pins.Sources {
			dirs = append(dirs, src.Dir)
		}
		for _, dir := range dirs {
			pinned, err := bpf.PinnedRuleCapacity(dir)
			if err != nil {
				return nil, err
			}
			maxRules = max(maxRules, pinned)
		}
		if maxRules == 0 {
			maxRules = bpf.CapacityFor(len(p.IPv4) + len(p.IPv6))
		}
	}
	if maxRules != 0 {
		lopts.MaxRules = maxRules
	}
	if !p.Enabled(policy.IPv6) && lopts.NATEntriesV6 == 0 {
		lopts.NATEntriesV6 = natEntriesNoIPv6
	}
	if aside, err := b.replaceResized(lopts); err != nil {
		return nil, err
	} else if aside && b.migration == nil {
		if pins, err = b.inspect(); err != nil {
			return nil, err
		}
		migrate = true
	}
	start := time.Now()
	dp, err := bpf.Load(lopts)
	if err != nil {
		return nil, err
	}
	if migrate {
		if err := b.migrate(dp, pins.Sources); err != nil {
			dp.Close()
			return nil, err
		}
	}
	rules, err := dp.InstalledRules()
	if err != nil {
		dp.Close()
		return nil, err
	}
	b.log.Info("datapath loaded", "pins", b.pinDir, "layout", bpf.Layout, "reusedRules", len(rules), "took", time.Since(start))
	return dp, nil
}

// inspect reads what is pinned, and refuses pins of a layout this agent does not know.
func (b *Backend) inspect() (bpf.Pins, error) {
	pins, err := bpf.Inspect(b.pinRoot)
	refused := ""
	if errors.Is(err, bpf.ErrUnknownLayout) {
		refused = err.Error()
		err = fmt.Errorf("%w: %w; nothing was changed (roll the agent forward, or run cleanup to start over without them)", datapath.ErrRefused, err)
	}
	b.mu.Lock()
	if refused != "" && b.refused == "" {
		b.log.Error("refusing the pinned maps: they are of a layout this agent does not know", "error", refused)
	}
	b.refused = refused
	b.mu.Unlock()
	return pins, err
}

// replaceResized makes Load make anew the maps of this layout whose size differs from what lopts
// asks: the flow state's are set aside (bpf.SetAside) for a migration to carry, which it tells,
// the others' pins removed.
func (b *Backend) replaceResized(lopts bpf.LoadOptions) (aside bool, err error) {
	mismatched, err := bpf.CheckPins(lopts)
	if err != nil || len(mismatched) == 0 {
		return false, err
	}
	var carried, dropped, why []string
	for _, m := range mismatched {
		if bpf.CarriedOnResize(m.Map) {
			carried = append(carried, m.Map)
		} else {
			dropped = append(dropped, m.Map)
		}
		why = append(why, m.Map+": "+m.Reason)
	}
	b.log.Warn("pinned maps have other sizes; replacing them, the flow state's carried into the new ones",
		"maps", why, "carried", carried, "startOver", dropped)
	if len(carried) > 0 {
		if _, err := bpf.SetAside(b.pinDir, carried...); err != nil {
			return false, err
		}
	}
	return len(carried) > 0, bpf.RemovePins(b.pinDir, dropped...)
}

// migrate carries what older layouts' pins hold into dp, before the programs are swapped.
func (b *Backend) migrate(dp *bpf.Datapath, srcs []bpf.Source) error {
	start := time.Now()
	mig, err := dp.Migrate(srcs)
	if err != nil {
		return err
	}
	b.migration = mig
	msg := "migrating the pinned maps of an older layout; their programs run until this agent's replace them"
	if !slices.ContainsFunc(srcs, func(s bpf.Source) bool { return !s.Resized() }) {
		msg = "carrying the entries of the resized maps into the new ones; the old ones serve the programs until this agent's replace them"
	}
	b.log.Info(msg, "from", fmt.Sprint(mig.Sources()), "to", bpf.Layout, "entries", mig.Entries, "took", time.Since(start))
	if mig.NoRoom > 0 {
		b.log.Warn("the confirmed NAT tables are smaller than the flows they held: those without room were carried into the unreplied ones, where they work but can be evicted",
			"entries", mig.NoRoom)
	}
	return nil
}

// finishMigration, after an Apply put this agent's programs on every uplink (and took them off
// every other device), carries what the old programs did meanwhile and removes the old pins.
func (b *Backend) finishMigration(dp *bpf.Datapath) error {
	if b.migration == nil {
		return nil
	}
	start := time.Now()
	before := maps.Clone(b.migration.Entries)
	if err := b.migration.Finish(dp); err != nil {
		return fmt.Errorf("finish the migration: %w", err)
	}
	caught := map[string]int{}
	for name, n := range b.migration.Entries {
		if n -= before[name]; n > 0 {
			caught[name] = n
		}
	}
	b.log.Info("migration finished: the old programs are replaced, their entries since carried, their pins removed",
		"from", fmt.Sprint(b.migration.Sources()), "caughtUp", caught, "took", time.Since(start))
	b.migration = nil
	return nil
}

// Counters implements datapath.Backend.
func (b *Backend) Counters(ctx context.Context) ([]datapath.RuleCounter, error) {
	dp := b.dp.Load()
	if dp == nil {
		return nil, nil
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	stats, err := dp.RuleStats()
	if err != nil {
		return nil, err
	}
	out := make([]datapath.RuleCounter, len(stats))
	for i, s := range stats {
		out[i] = datapath.RuleCounter{Family: s.Rule.Family, Rule: s.Number, Prefix: s.Rule.Prefix,
			Action: s.Rule.Action, Origin: s.Rule.Origin, Entry: s.Rule.Entry, Packets: s.Packets, Bytes: s.Bytes}
	}
	return out, nil
}

// NATStats implements datapath.NATReporter.
func (b *Backend) NATStats(ctx context.Context) (datapath.NATStats, error) {
	dp := b.dp.Load()
	if dp == nil {
		return emptyStats(), nil
	}
	return natStats(ctx, dp)
}

// NATSummary implements datapath.NATReporter.
func (b *Backend) NATSummary(ctx context.Context, top int) (datapath.NATSummary, error) {
	dp := b.dp.Load()
	if dp == nil {
		return datapath.NATSummary{}, nil
	}
	return natSummary(ctx, dp, top)
}

// Cleanup implements datapath.Backend: everything the BPF backend installs under the bpffs it
// was given, and its programs on every device.
func (b *Backend) Cleanup(ctx context.Context) error {
	_, err := Cleanup(ctx, b.opts.BPFFS, b.opts.Logger)
	return err
}

// Close stops following the uplinks and sweeping, and releases descriptors. Programs, maps and
// links stay installed.
func (b *Backend) Close() error {
	b.stop()
	b.wg.Wait()
	var errs []error
	if dp := b.dp.Load(); dp != nil {
		errs = append(errs, dp.Close())
	}
	errs = append(errs, b.attach.Close())
	b.resolve.Close()
	return errors.Join(errs...)
}

// sweepLoop expires idle NAT entries until ctx ends.
func (b *Backend) sweepLoop(ctx context.Context) {
	t := time.NewTicker(b.opts.SweepInterval)
	defer t.Stop()
	held := 0 // ports of earlier --to-ports ranges held, as last logged
	var timeouts bpf.Timeouts
	b.timeouts(&timeouts)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		dp := b.dp.Load()
		if dp == nil {
			continue
		}
		start := time.Now()
		res, err := dp.Sweep(bpf.MonotonicNow(), b.timeouts(&timeouts))
		if err != nil {
			b.log.Warn("NAT sweep failed", "error", err)
			continue
		}
		if res.Flows > 0 || res.Orphans > 0 {
			b.log.Debug("NAT sweep", "flows", res.Flows, "orphanEntries", res.Orphans, "took", time.Since(start))
		}
		held = b.trimHeldPorts(dp, held)
		b.checkDraining(ctx, dp)
	}
}

// timeouts are the sweep's timeouts now, from the options and the node's conntrack sysctls
// (bpf.ResolveTimeouts), logged when they differ from *last, which they replace. The sysctls are
// read at every sweep, so that a change of them, or the nf_conntrack module loaded later (by
// kube-proxy), applies here as it applies to conntrack.
func (b *Backend) timeouts(last *bpf.Timeouts) bpf.Timeouts {
	t, from := bpf.ResolveTimeouts(b.opts.Timeouts, cmp.Or(b.opts.ConntrackDir, bpf.ConntrackSysctlDir))
	if t != *last {
		var attrs []any
		for _, k := range bpf.TimeoutKeys {
			attrs = append(attrs, k.Name, fmt.Sprintf("%v (%s)", *k.Of(&t), from[k.Name]))
		}
		b.log.Info("NAT timeouts", attrs...)
		*last = t
	}
	return t
}

// trimHeldPorts lets go of the ports of earlier --to-ports ranges whose flows have ended (see
// bpf.Datapath.TrimHeldPorts), says how many stay held when that changed from was, and returns
// the new count.
func (b *Backend) trimHeldPorts(dp *bpf.Datapath, was int) int {
	n, err := dp.TrimHeldPorts()
	if err != nil {
		b.log.Warn("cannot release the ports of earlier --to-ports ranges", "error", err)
		return was
	}
	switch {
	case n == was:
	case n == 0:
		b.log.Info("the flows of earlier --to-ports ranges have ended: their ports are released")
	default:
		b.log.Info("ports of earlier --to-ports ranges stay held for their flows", "ports", n)
	}
	return n
}
