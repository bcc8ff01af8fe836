package bpfbackend

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/uplink"
)

// Installed reads a BPF datapath pinned under <bpffs>/ip-masq-agent/ (its layout's directory)
// from any process, through read-only map descriptors: it never changes what it reads. It is the
// BPF backend's installed-state reader, as iptables.Installed and nftables.Installed are theirs.
type Installed struct {
	dp     *bpf.Datapath
	p      *policy.Policy
	info   datapath.Info
	mode   string
	pinDir string
	// interfaces is --interfaces, which Uplinks resolves with.
	interfaces []string
}

var (
	_ datapath.Reader       = (*Installed)(nil)
	_ datapath.NATReporter  = (*Installed)(nil)
	_ datapath.HookReporter = (*Installed)(nil)
)

// Inspect opens what is pinned under bpffs, or returns nil and no error when nothing is.
// p, the configuration the reader is given (nil when it has none), says which configured rule
// each installed one is, and, with interfaces (--interfaces), which devices are uplinks. Pins
// of another layout than this build's are not read: an older layout's are migrated by the next
// agent, a newer one's belong to a newer agent (and dump).
func Inspect(bpffs string, interfaces []string, p *policy.Policy) (*Installed, error) {
	root := filepath.Join(bpffs, PinDir)
	dp, err := bpf.OpenReadOnly(root)
	if err != nil {
		return nil, fmt.Errorf("read the BPF datapath pinned under %s: %w", root, err)
	}
	if dp == nil {
		return nil, nil
	}
	dir := bpf.LayoutDir(root)
	// tcx links are pinned; clsact filters are not.
	mode := tc.ModeTC
	if links, err := os.ReadDir(filepath.Join(root, LinkDir)); err == nil && len(links) > 0 {
		mode = tc.ModeTCX
	}
	return &Installed{dp: dp, p: p, info: readInfo(dp, dir, mode), mode: mode, pinDir: dir, interfaces: interfaces}, nil
}

// Close releases the descriptors.
func (r *Installed) Close() error { return r.dp.Close() }

// Info implements datapath.InfoReporter: the attach mode as the pins tell it, and the uplinks
// the maps held when the reader was opened.
func (r *Installed) Info() datapath.Info { return r.info }

// readInfo reads what Info reports.
func readInfo(dp *bpf.Datapath, pinDir, mode string) datapath.Info {
	s := "maps pinned under " + pinDir
	var ups []string
	for _, u := range installedUplinks(dp) {
		ups = append(ups, u.String())
	}
	if len(ups) > 0 {
		slices.Sort(ups)
		s += "; uplinks " + strings.Join(ups, ", ")
	}
	best, _, err := tc.Probe()
	if err != nil {
		best = tc.ModeTC // cannot tell: say what this reader does not know as missing, not as there
	}
	return datapath.Info{Backend: Name, AttachMode: mode, Details: s, Missing: Missing(best)}
}

// installedUplinks are the devices uplink_snat holds, with their names ("?" for a device that
// is gone) and SNAT addresses. A report: what cannot be read is left out.
func installedUplinks(dp *bpf.Datapath) []uplink.Uplink {
	snat, _ := dp.Uplinks()
	var out []uplink.Uplink
	for idx, u := range snat {
		ul := uplink.Uplink{Name: "?", Index: idx, IPv4: u.IPv4, IPv6: u.IPv6}
		if ifc, err := net.InterfaceByIndex(idx); err == nil {
			ul.Name = ifc.Name
		}
		out = append(out, ul)
	}
	slices.SortFunc(out, func(a, b uplink.Uplink) int { return a.Index - b.Index })
	return out
}

// Hooks implements datapath.HookReporter: the programs of others on each uplink's hooks, and,
// where one runs ahead of ours, whether ours is bypassed (which takes two samples of the hook,
// a fraction of a second apart).
func (r *Installed) Hooks(ctx context.Context) ([]datapath.Hook, error) {
	return readHooks(ctx, r.dp, r.mode, r.pinDir, installedUplinks(r.dp))
}

// Counters implements datapath.Reader: the installed rules with their counters, as the
// configuration the reader was given explains them (ruleCounters).
func (r *Installed) Counters(ctx context.Context) ([]datapath.RuleCounter, error) {
	return ruleCounters(ctx, r.dp, r.p, true)
}

// NATStats implements datapath.NATReporter, counting the tables' entries now.
func (r *Installed) NATStats(ctx context.Context) (datapath.NATStats, error) {
	return natStats(ctx, r.dp, r.dp.CountNAT)
}

// NATSummary implements datapath.NATReporter.
func (r *Installed) NATSummary(ctx context.Context, top int) (datapath.NATSummary, error) {
	return natSummary(ctx, r.dp, top)
}

// sweptProtocols are the protocols the sweep reports from the start, zero or not, so that their
// series exist before the first removal.
var sweptProtocols = []uint8{unix.IPPROTO_TCP, unix.IPPROTO_UDP, unix.IPPROTO_ICMP, unix.IPPROTO_ICMPV6}

func emptyStats() datapath.NATStats {
	st := datapath.NATStats{Events: map[string]uint64{}, Drops: map[string]uint64{}, Swept: map[string]uint64{}}
	for _, e := range bpf.Events() {
		setEvent(&st, e, 0)
	}
	for _, p := range sweptProtocols {
		st.Swept[datapath.ProtocolName(p)] = 0
	}
	return st
}

// setEvent records an event's count in st, by name, and a drop's by reason too.
func setEvent(st *datapath.NATStats, e bpf.Event, n uint64) {
	st.Events[e.String()] = n
	if reason, ok := e.DropReason(); ok {
		st.Drops[reason] = n
	}
}

// natStats are dp's NAT statistics, with its tables' entries as counted gives them.
func natStats(ctx context.Context, dp *bpf.Datapath, counted func(policy.Family) ([]bpf.NATCount, error)) (datapath.NATStats, error) {
	st := emptyStats()
	for _, fam := range policy.Families() {
		if err := ctx.Err(); err != nil {
			return datapath.NATStats{}, err
		}
		counts, err := counted(fam)
		if err != nil {
			return datapath.NATStats{}, err
		}
		type key struct{ proto, state string }
		byState := map[key]uint64{}
		byTable := map[bpf.Table]uint64{}
		for _, c := range counts {
			byState[key{datapath.ProtocolName(c.Proto), c.State.String()}] += c.N
			byTable[c.Table] += c.N
		}
		for _, k := range slices.SortedFunc(maps.Keys(byState), func(a, b key) int {
			return cmp.Or(cmp.Compare(a.proto, b.proto), cmp.Compare(a.state, b.state))
		}) {
			st.Entries = append(st.Entries, datapath.NATEntries{Family: fam, Protocol: k.proto, State: k.state, Entries: byState[k]})
		}
		for _, t := range bpf.Tables() {
			st.Tables = append(st.Tables, datapath.NATTable{Family: fam, Table: t.String(), Entries: byTable[t],
				Capacity: uint64(dp.Capacity(fam, t))})
		}
	}
	ev, err := dp.EventCounts()
	if err != nil {
		return datapath.NATStats{}, err
	}
	for _, e := range bpf.Events() {
		setEvent(&st, e, ev[e])
	}
	st.PortAllocationRetries = ev[bpf.EventPortRetry]
	st.PortAllocationFailures = ev[bpf.EventDropNoPort]
	st.EstablishedEvictable = ev[bpf.EventConfirmFull]
	attempts, err := dp.PortAttempts()
	if err != nil {
		return datapath.NATStats{}, err
	}
	st.PortAttempts = datapath.Histogram{Counts: attempts.Counts, Sum: float64(attempts.Sum)}
	for i := range attempts.Counts {
		st.PortAttempts.Bounds = append(st.PortAttempts.Bounds, bpf.PortAttemptBound(i))
	}
	swept, err := dp.SweptEntries()
	if err != nil {
		return datapath.NATStats{}, err
	}
	for proto, n := range swept {
		st.Swept[datapath.ProtocolName(proto)] += n
	}
	return st, nil
}

// natSummary counts entries by family, protocol and state (a flow's two halves count in its
// state; a half without its partner by its own flags), and the remote endpoints with the most.
func natSummary(ctx context.Context, dp *bpf.Datapath, top int) (datapath.NATSummary, error) {
	type stateKey struct {
		fam   policy.Family
		proto string
		state string
	}
	type halfKey struct {
		proto    uint8
		src, dst netip.AddrPort
	}
	type remoteKey struct {
		proto    string
		endpoint netip.AddrPort
	}
	states := map[stateKey]uint64{}
	remotes := map[remoteKey]uint64{}
	for _, fam := range policy.Families() {
		paired := map[halfKey]bool{}
		if err := dp.Flows(fam, func(f bpf.Flow) bool {
			n := uint64(1)
			if !f.Partial {
				n = 2
				paired[halfKey{f.Ingress.Proto, f.Ingress.Src, f.Ingress.Dst}] = true
			}
			proto := datapath.ProtocolName(f.Egress.Proto)
			states[stateKey{fam, proto, f.State.String()}] += n
			remotes[remoteKey{proto, f.Egress.Dst}] += n
			return ctx.Err() == nil
		}); err != nil {
			return datapath.NATSummary{}, err
		}
		// Ingress halves whose egress half is gone.
		if err := dp.NATEntries(fam, func(e bpf.NATEntry) bool {
			if e.Dir != bpf.Ingress || paired[halfKey{e.Proto, e.Src, e.Dst}] {
				return ctx.Err() == nil
			}
			proto := datapath.ProtocolName(e.Proto)
			states[stateKey{fam, proto, bpf.StateOf(e.Flags, 0).String()}]++
			remotes[remoteKey{proto, e.Src}]++
			return ctx.Err() == nil
		}); err != nil {
			return datapath.NATSummary{}, err
		}
		// The kept verdicts of flows the policy left alone: one entry each, no partner.
		counts, err := dp.CountNAT(fam)
		if err != nil {
			return datapath.NATSummary{}, err
		}
		for _, c := range counts {
			if c.Table == bpf.TableKeep {
				states[stateKey{fam, datapath.ProtocolName(c.Proto), c.State.String()}] += c.N
			}
		}
		if err := ctx.Err(); err != nil {
			return datapath.NATSummary{}, err
		}
	}
	var sum datapath.NATSummary
	for k, n := range states {
		sum.Entries = append(sum.Entries, datapath.NATEntries{Family: k.fam, Protocol: k.proto, State: k.state, Entries: n})
	}
	slices.SortFunc(sum.Entries, func(a, b datapath.NATEntries) int {
		return cmp.Or(cmp.Compare(a.Family, b.Family), cmp.Compare(a.Protocol, b.Protocol), cmp.Compare(a.State, b.State))
	})
	if top > 0 {
		for k, n := range remotes {
			sum.Busiest = append(sum.Busiest, datapath.RemoteEndpoint{Protocol: k.proto, Endpoint: k.endpoint, Entries: n})
		}
		slices.SortFunc(sum.Busiest, func(a, b datapath.RemoteEndpoint) int {
			return cmp.Or(cmp.Compare(b.Entries, a.Entries), cmp.Compare(a.Protocol, b.Protocol), a.Endpoint.Compare(b.Endpoint))
		})
		if len(sum.Busiest) > top {
			sum.Busiest = sum.Busiest[:top]
		}
	}
	return sum, nil
}
