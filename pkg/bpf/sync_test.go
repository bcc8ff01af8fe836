package bpf

import (
	"bytes"
	"cmp"
	"errors"
	"maps"
	"math/rand/v2"
	"net/netip"
	"os"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

func prefixes(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParsePrefix(s)
	}
	return out
}

func compile(masq, nonMasq []netip.Prefix, outbound bool) *policy.Policy {
	return withAddrs(masq, nonMasq, outbound, nil)
}

// withAddrs is compile with masquerade addresses of their own for the masqueradeCIDRs entries
// named in addrs (CIDR -> address).
func withAddrs(masq, nonMasq []netip.Prefix, outbound bool, addrs map[string]string) *policy.Policy {
	cfg := config.Config{NonMasqueradeCIDRs: nonMasq, MasqOutBound: outbound, MasqOutBoundIPv6: outbound}
	for _, p := range masq {
		m := config.MasqueradeCIDR{CIDR: p}
		if a, ok := addrs[p.String()]; ok {
			m.Address = netip.MustParseAddr(a)
		}
		cfg.MasqueradeCIDRs = append(cfg.MasqueradeCIDRs, m)
	}
	return policy.Compile(cfg, policy.Options{EnableIPv6: true, RandomFully: true})
}

// statsByPrefix maps each rule's prefix and action to its counters.
func (h *harness) statsByPrefix() map[string]RuleStats {
	h.t.Helper()
	stats, err := h.dp.RuleStats()
	if err != nil {
		h.t.Fatal(err)
	}
	out := map[string]RuleStats{}
	for _, s := range stats {
		out[s.Rule.Prefix.String()+" "+s.Rule.Action.String()] = s
	}
	return out
}

// TestSyncKeepsCounters: rules that stay across a sync keep their slot and their counters,
// even when rules before them come and go; a new rule starts at zero even when it reuses the
// slot of a removed rule.
func TestSyncKeepsCounters(t *testing.T) {
	a := compile(prefixes("10.9.0.0/16"), prefixes("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"), true)
	// 6 IPv4 rules and 2 IPv6 rules; one more slot for the rule B adds before it drops one.
	h := newHarness(t, a, LoadOptions{MaxRules: 9})
	hit := func(dst string, n int) {
		for i := 0; i < n; i++ {
			h.mustPass(h.dp.Egress(), udpPacket(ap(pod4(1000+i), 999), ap(netip.MustParseAddr(dst), 53), nil))
		}
	}
	hit("10.9.1.1", 3)    // masquerade 10.9/16
	hit("10.1.1.1", 4)    // return 10/8
	hit("172.16.1.1", 5)  // return 172.16/12
	hit("192.168.1.1", 6) // return 192.168/16
	hit("8.8.8.8", 7)     // outbound
	first := h.statsByPrefix()

	b := compile(prefixes("10.9.0.0/16"), prefixes("100.64.0.0/10", "10.0.0.0/8", "192.168.0.0/16"), true)
	if err := h.dp.SyncPolicy(b); err != nil {
		t.Fatal(err)
	}
	second := h.statsByPrefix()
	for _, k := range []string{"10.9.0.0/16 MASQUERADE", "10.0.0.0/8 RETURN", "192.168.0.0/16 RETURN", "0.0.0.0/0 MASQUERADE", "169.254.0.0/16 RETURN"} {
		if second[k].Packets != first[k].Packets || second[k].Slot != first[k].Slot {
			t.Errorf("%s: %d packets in slot %d before the sync, %d in slot %d after", k,
				first[k].Packets, first[k].Slot, second[k].Packets, second[k].Slot)
		}
	}
	if n := second["100.64.0.0/10 RETURN"].Packets; n != 0 {
		t.Errorf("new rule starts with %d packets", n)
	}
	hit("10.1.1.1", 1)
	if n := h.statsByPrefix()["10.0.0.0/8 RETURN"].Packets; n != 5 {
		t.Errorf("10.0.0.0/8 counts %d after one more packet, want 5", n)
	}

	// 172.16/12 comes back: it takes the only free slot, its own old one, zeroed.
	c := compile(prefixes("10.9.0.0/16"), prefixes("100.64.0.0/10", "10.0.0.0/8", "192.168.0.0/16", "172.16.0.0/12"), true)
	if err := h.dp.SyncPolicy(c); err != nil {
		t.Fatal(err)
	}
	third := h.statsByPrefix()
	back := third["172.16.0.0/12 RETURN"]
	if back.Slot != first["172.16.0.0/12 RETURN"].Slot {
		t.Fatalf("expected the freed slot %d to be reused, got %d", first["172.16.0.0/12 RETURN"].Slot, back.Slot)
	}
	if back.Packets != 0 || back.Bytes != 0 {
		t.Errorf("reused slot not zeroed: %d packets %d bytes", back.Packets, back.Bytes)
	}
	// The slot table in the maps says which rule owns each slot.
	var v masqRuleSlot
	if err := h.dp.objs.RuleSlots.Lookup(back.Slot, &v); err != nil {
		t.Fatal(err)
	}
	if k, ok := slotKeyOf(v); !ok || k.prefix() != netip.MustParsePrefix("172.16.0.0/12") || k.policyOrigin() != policy.OriginNonMasqueradeCIDRs {
		t.Errorf("rule_slots[%d] = %+v", back.Slot, v)
	}

	// A policy needing more slots than there are fails before writing anything.
	d := compile(prefixes("10.9.0.0/16", "10.8.0.0/16", "10.7.0.0/16"), prefixes("10.0.0.0/8"), true)
	if err := h.dp.SyncPolicy(d); err == nil {
		t.Fatal("sync beyond MaxRules succeeded")
	}
}

// TestSyncTries: after any sequence of syncs the tries hold exactly what the last policy asks.
func TestSyncTries(t *testing.T) {
	h := newHarness(t, nil, LoadOptions{})
	policies := []*policy.Policy{
		compile(prefixes("10.9.0.0/16", "2001:db8:9::/48"), prefixes("10.0.0.0/8", "fd00::/8"), true),
		compile(nil, prefixes("10.0.0.0/8", "10.0.0.0/8", "10.1.0.0/16"), false),
		compile(prefixes("0.0.0.0/0"), prefixes("192.168.0.0/16", "::/0"), true),
		compile(nil, nil, true),
		// Addresses: each entry holds its first-matching rule's (10.9.1.0/24 lies inside
		// 10.9.0.0/16, which comes first); changing one rewrites its entries.
		withAddrs(prefixes("10.9.0.0/16", "10.9.1.0/24", "10.8.0.0/16", "2001:db8:9::/48"), prefixes("10.0.0.0/8"), true,
			map[string]string{"10.9.0.0/16": "192.0.2.11", "10.9.1.0/24": "192.0.2.12", "2001:db8:9::/48": "2001:db8::11"}),
		withAddrs(prefixes("10.9.0.0/16", "10.9.1.0/24", "10.8.0.0/16", "2001:db8:9::/48"), prefixes("10.0.0.0/8"), true,
			map[string]string{"10.9.0.0/16": "192.0.2.13", "10.8.0.0/16": "192.0.2.12"}),
		compile(prefixes("10.9.0.0/16", "10.9.1.0/24", "10.8.0.0/16", "2001:db8:9::/48"), prefixes("10.0.0.0/8"), true),
	}
	for i, p := range policies {
		if err := h.dp.SyncPolicy(p); err != nil {
			t.Fatal(err)
		}
		pl, _ := makePlan(p, nil)
		slots := h.dp.slotsByRule()
		for _, tr := range h.dp.tries {
			name := tr.name
			got := map[netip.Prefix]trieValue{}
			// The map itself, not the mirror.
			if err := tr.ops.read(tr.m, func(p trieKey, v trieValue) { got[p] = v }); err != nil {
				t.Fatal(err)
			}
			if len(got) != len(pl.tries[tr.trieKind]) {
				t.Fatalf("policy %d: %s holds %d entries, want %d: %v", i, name, len(got), len(pl.tries[tr.trieKind]), got)
			}
			for _, e := range pl.tries[tr.trieKind] {
				want := trieValue{action: tr.action, slot: slots[pl.rules[e.idx]]}
				if tr.action == policy.Masquerade {
					want.snat = pl.rules[e.idx].Address
				}
				if v, ok := got[e.prefix]; !ok || v != want {
					t.Fatalf("policy %d: %s[%s] = %+v (present %v), want %+v", i, name, e.prefix, v, ok, want)
				}
			}
		}
	}
}

// TestSyncNoGap: while policies that decide the same for some addresses replace each other,
// packets to those addresses never see another verdict: entries are added before stale ones go.
func TestSyncNoGap(t *testing.T) {
	// With masqOutBound false, a gap in the masquerade trie would let 8.8.8.8 out unmasqueraded;
	// with a gap in the non-masquerade trie, 10.5.5.5 would fall to... RETURN as well, so the
	// second pair masquerades the rest to make that gap visible too.
	// The third pair deletes 10.0.0.0/8 while it writes the halves, one entry at a time
	// (passingSteps): until the second is written, 10.200.5.5 has only the /8.
	pairs := [][2]*policy.Policy{
		{compile(prefixes("8.8.0.0/16"), nil, false), compile(prefixes("8.8.0.0/17", "8.8.128.0/17"), nil, false)},
		{compile(nil, prefixes("10.0.0.0/8"), true), compile(nil, prefixes("10.0.0.0/9", "10.128.0.0/9"), true)},
		{compile(nil, prefixes("10.0.0.0/8"), true), compile(nil, prefixes("10.0.0.0/9", "10.128.0.0/9"), true)},
	}
	probes := []struct {
		dst  netip.Addr
		masq bool
	}{{netip.MustParseAddr("8.8.8.8"), true}, {netip.MustParseAddr("10.5.5.5"), false}, {netip.MustParseAddr("10.200.5.5"), false}}
	defer func(n int) { trieChunk = n }(trieChunk)
	trieChunk = 1
	for i, pair := range pairs {
		h := newHarness(t, pair[0], LoadOptions{})
		probe := probes[i]
		var stop atomic.Bool
		var wg sync.WaitGroup
		var bad atomic.Value
		var probed atomic.Int64
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := 0; !stop.Load(); n++ {
				probed.Add(1)
				// Each probe is a new flow; a destination port of its own keeps the masqueraded
				// ones from filling one remote endpoint's port range, whose exhaustion (a drop)
				// would look like a flipped verdict on a slow machine.
				in := udpPacket(ap(probeSource(policy.IPv4, n), 4000), ap(probe.dst, uint16(1+n%60000)), nil)
				_, out, err := runCtxErr(h.dp.Egress(), in, forwarded)
				if err != nil {
					bad.Store(err.Error())
					return
				}
				masq := !bytes.Equal(out[14+12:14+16], in[14+12:14+16])
				if masq != probe.masq {
					bad.Store("verdict flipped during a sync for " + probe.dst.String())
					return
				}
			}
		}()
		for probed.Load() == 0 && bad.Load() == nil {
			runtime.Gosched() // the probes must run while the syncs do
		}
		// At least 300 syncs, and as many probes while they run (on a busy machine the probes
		// may lag: the syncs go on until they caught up, for at most 20 s).
		before := probed.Load()
		deadline := time.Now().Add(20 * time.Second)
		n := 0
		for ; (n < 300 || probed.Load()-before < 300) && bad.Load() == nil && time.Now().Before(deadline); n++ {
			if err := h.dp.SyncPolicy(pair[(n+1)%2]); err != nil {
				t.Fatal(err)
			}
		}
		during := probed.Load() - before
		stop.Store(true)
		wg.Wait()
		if msg := bad.Load(); msg != nil {
			t.Fatal(msg)
		}
		if during < 300 {
			t.Fatalf("only %d probes ran during %d syncs", during, n)
		}
	}
}

// TestPinnedReuse: a datapath loaded over pinned maps continues with the previous one's flows,
// rules and counters.
func TestPinnedReuse(t *testing.T) {
	h := &harness{t: t}
	dir := testutil.MountBPFFS(t)
	p := defaultPolicy(true)
	load := func(opts LoadOptions) *Datapath {
		opts.PinPath = dir
		dp, err := Load(opts)
		if err != nil {
			t.Fatal(err)
		}
		return dp
	}
	first := load(LoadOptions{})
	h.dp = first
	if err := first.SyncPolicy(p); err != nil {
		t.Fatal(err)
	}
	if _, err := first.SetUplink(testIfindex, Uplink{IPv4: snat4}); err != nil {
		t.Fatal(err)
	}
	podEnd, dst := ap(pod4(5), 40000), ap(remote4, 443)
	nat := tupleOf(t, h.mustPass(first.Egress(), tcpPacket(podEnd, dst, tcpSYN, nil))).src
	before := h.statsByPrefix()
	first.Close()

	second := load(LoadOptions{})
	defer second.Close()
	h.dp = second
	if err := second.SyncPolicy(p); err != nil {
		t.Fatal(err)
	}
	after := h.statsByPrefix()
	for k, s := range before {
		if after[k].Slot != s.Slot || after[k].Packets != s.Packets {
			t.Errorf("%s: slot %d with %d packets before the reload, slot %d with %d after", k, s.Slot, s.Packets, after[k].Slot, after[k].Packets)
		}
	}
	back := tupleOf(t, h.mustPass(second.Ingress(), tcpPacket(dst, nat, tcpSYN|tcpACK, nil)))
	if back.dst != podEnd {
		t.Fatalf("reply after the reload arrives at %s, want %s", back.dst, podEnd)
	}
	for name := range second.Maps() {
		if _, err := os.Stat(dir + "/" + name); err != nil {
			t.Errorf("map %s not pinned: %v", name, err)
		}
	}

	// A reader in another process sees the same rules, counters and flows without loading
	// programs.
	reader, err := OpenPinned(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Close()
	if reader.Egress() != nil {
		t.Fatal("OpenPinned loaded programs")
	}
	installed, err := reader.InstalledRules()
	if err != nil {
		t.Fatal(err)
	}
	if len(installed) != len(after) {
		t.Fatalf("%d installed rules, %d configured", len(installed), len(after))
	}
	for _, r := range installed {
		s, ok := after[r.Prefix.String()+" "+r.Action.String()]
		if !ok || s.Slot != r.Slot || s.Packets != r.Packets || s.Bytes != r.Bytes || s.Rule.Origin != r.Origin || r.Dup != 0 {
			t.Errorf("installed %+v, configured %+v", r, s)
		}
	}
	var flows []Flow
	if err := reader.Flows(policy.IPv4, func(f Flow) bool { flows = append(flows, f); return true }); err != nil {
		t.Fatal(err)
	}
	if len(flows) != 1 || flows[0].Egress.Src != podEnd || flows[0].Egress.To != nat || flows[0].State != StateEstablished {
		t.Fatalf("flows read from the pins: %+v", flows)
	}
	if _, err := OpenPinned(t.TempDir()); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("OpenPinned on an empty directory: %v, want ErrNotExist", err)
	}

	// Other sizes cannot reuse the pins.
	if _, err := Load(LoadOptions{PinPath: dir, NATEntries: 1 << 10}); !errors.Is(err, ebpf.ErrMapIncompatible) {
		t.Fatalf("loading with another NAT size over the pins: %v, want ErrMapIncompatible", err)
	}
	if err := second.Unpin(); err != nil {
		t.Fatal(err)
	}
	for name := range second.Maps() {
		if _, err := os.Stat(dir + "/" + name); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("pin of %s left after Unpin: %v", name, err)
		}
	}
}

// TestSyncPortRanges: a change of --to-ports takes effect for new flows; flows that have a
// port keep it.
func TestSyncPortRanges(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	dst := ap(remote4, 443)
	old := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(ap(pod4(1), 1234), dst, tcpSYN, nil))).src
	if old.Port() < policy.DefaultPortRange.First {
		t.Fatalf("port %d outside the default range", old.Port())
	}
	narrow := defaultPolicy(true)
	narrow.ToPorts = policy.PortRanges{{First: 5000, Last: 5001}, {First: 6000, Last: 6002}}
	if err := h.dp.SyncPolicy(narrow); err != nil {
		t.Fatal(err)
	}
	for i := 2; i < 7; i++ {
		p := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(ap(pod4(i), 1234), dst, tcpSYN, nil))).src.Port()
		if !(p >= 5000 && p <= 5001 || p >= 6000 && p <= 6002) {
			t.Fatalf("new flow got port %d outside 5000-5001,6000-6002", p)
		}
	}
	if got := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(ap(pod4(1), 1234), dst, tcpACK, nil))).src; got != old {
		t.Fatalf("existing flow moved from %s to %s", old, got)
	}
	if err := h.dp.SyncPolicy(defaultPolicy(true)); err != nil {
		t.Fatal(err)
	}
	if p := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(ap(pod4(9), 1234), dst, tcpSYN, nil))).src.Port(); p < policy.DefaultPortRange.First {
		t.Fatalf("port %d after returning to the default range", p)
	}
}

// verifierBudget is the guard TestVerifierComplexity keeps each program within: well within the
// verifier's budget of a million processed instructions, so that other kernels' verifiers (which
// explore differently) load them too. Every kernel of the matrix keeps half of it in reserve.
const verifierBudget = 300_000

// verifiedInstructions matches the count in a verifier log's statistics.
var verifiedInstructions = regexp.MustCompile(`processed (\d+) insns`)

// TestVerifierComplexity keeps the programs within half of verifierBudget on every kernel, and
// prints how many instructions this kernel's verifier processed for each and the headroom that
// leaves (bpf/masq.c says where the work goes). The count is read from the verifier's
// statistics, which every kernel writes (the program info has it only from 5.16).
func TestVerifierComplexity(t *testing.T) {
	testutil.RequirePrivileged(t)
	if err := raiseMemlock(); err != nil {
		t.Fatal(err)
	}
	spec, err := LoadOptions{}.withDefaults().spec()
	if err != nil {
		t.Fatal(err)
	}
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{Programs: ebpf.ProgramOptions{LogLevel: ebpf.LogLevelStats}})
	if err != nil {
		t.Fatalf("%+v", err)
	}
	defer coll.Close()
	for _, name := range []string{masqProgTcEgress, masqProgTcIngress} {
		m := verifiedInstructions.FindStringSubmatch(coll.Programs[name].VerifierLog)
		if m == nil {
			t.Fatalf("%s: no instruction count in the verifier's statistics:\n%s", name, coll.Programs[name].VerifierLog)
		}
		n, _ := strconv.Atoi(m[1])
		t.Logf("%s: %d instructions processed by the verifier, %.1fx headroom under the guard of %d",
			name, n, float64(verifierBudget)/float64(n), verifierBudget)
		if 2*n > verifierBudget {
			t.Errorf("%s: the verifier processed %d instructions; keep it under half the guard, %d", name, n, verifierBudget/2)
		}
	}
}

// TestHeldSlotsAcrossEdits: the slots a sync finds held, which heldSlots takes from the last
// sync's keys where they line up, are the slot table's, over random edits of a list: rules
// inserted, removed, replaced and moved anywhere, duplicates among them.
func TestHeldSlotsAcrossEdits(t *testing.T) {
	pool := make([]netip.Prefix, 40)
	for i := range pool {
		pool[i] = netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i / 4), byte(i % 4 * 64), 0}), 18+i%7).Masked()
	}
	rng := rand.New(rand.NewPCG(7, 28))
	draw := func() netip.Prefix { return pool[rng.IntN(len(pool))] }
	masq, nonMasq := []netip.Prefix{draw(), draw()}, []netip.Prefix{draw(), draw(), draw()}
	h := newHarness(t, compile(masq, nonMasq, true), LoadOptions{MaxRules: 256})
	edit := func(list []netip.Prefix) []netip.Prefix {
		list = slices.Clone(list)
		switch i := rng.IntN(len(list) + 1); rng.IntN(4) {
		case 0:
			list = slices.Insert(list, i, draw())
		case 1:
			if i < len(list) {
				list = slices.Delete(list, i, i+1)
			}
		case 2:
			if i < len(list) {
				list[i] = draw()
			}
		default:
			if j := rng.IntN(len(list) + 1); i < len(list) && j < len(list) {
				list[i], list[j] = list[j], list[i]
			}
		}
		return list
	}
	for round := range 300 {
		for range 1 + rng.IntN(3) {
			if rng.IntN(3) == 0 {
				masq = edit(masq)
			} else {
				nonMasq = edit(nonMasq)
			}
		}
		p := compile(masq, nonMasq, rng.IntN(4) > 0)
		h.dp.mu.Lock()
		pl, err := makePlan(p, nil)
		if err != nil {
			h.dp.mu.Unlock()
			t.Fatal(err)
		}
		held := h.dp.heldSlots(pl)
		for i, k := range pl.keys {
			want, ok := h.dp.slots.byKey[k]
			if !ok {
				want = noSlot
			}
			if held[i] != want {
				h.dp.mu.Unlock()
				t.Fatalf("round %d: key %d (%s) held slot %d, the table says %d", round, i, k.prefix(), held[i], want)
			}
		}
		h.dp.mu.Unlock()
		if err := h.dp.SyncPolicy(p); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		requireSyncedSlots(t, h.dp, round)
	}
}

// TestSortStableAbove: the radix sort orders by the bits from shift up as a stable comparison
// sort does, whatever number of its passes are skipped.
func TestSortStableAbove(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	masks := []uint64{^uint64(0), 0x7ff << 26, 0x7ff<<26 | 0x7ff<<48, 0xff << 56, 0x3 << 40}
	for _, n := range []int{0, 1, 2, 3, 100, 5000} {
		for _, mask := range masks {
			keys := make([]uint64, n)
			for i := range keys {
				keys[i] = rng.Uint64()&mask | uint64(i)&(1<<26-1) // the low bits: the order they came in
			}
			for _, shift := range []uint{0, 26} {
				got, want := slices.Clone(keys), slices.Clone(keys)
				slices.SortStableFunc(want, func(a, b uint64) int { return cmp.Compare(a>>shift, b>>shift) })
				sortStableAbove(got, shift)
				if !slices.Equal(got, want) {
					t.Fatalf("%d keys, mask %#x, shift %d: sorted differently from a stable sort", n, mask, shift)
				}
			}
		}
	}
}

// TestRecoveredDuplicateSlot: rule_slots read back with a rule's key at two slots (pins written
// by hand, or by a faulty agent) leave the table consistent once a sync frees the extra slot:
// the rule keeps the slot the table gave it, and the next sync finds it there.
func TestRecoveredDuplicateSlot(t *testing.T) {
	p := compile(prefixes("10.9.0.0/16"), prefixes("10.0.0.0/8", "192.168.0.0/16"), true)
	h := newHarness(t, p, LoadOptions{MaxRules: 64})
	k := h.dp.syncedPlan.keys[0]
	v := k.value()
	extra := h.dp.slots.next + 5 // after the rule's own slot: the one recover keeps
	if err := h.dp.objs.RuleSlots.Put(extra, &v); err != nil {
		t.Fatal(err)
	}
	h.dp.mu.Lock()
	err := h.dp.recover()
	h.dp.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	for round := range 2 {
		if err := h.dp.SyncPolicy(p); err != nil {
			t.Fatal(err)
		}
		requireSyncedSlots(t, h.dp, round)
	}
	if s := h.dp.syncedSlots[0]; s != extra {
		t.Fatalf("the rule holds slot %d, want %d, the one the table read last", s, extra)
	}
}

// requireSyncedSlots fails unless the slot table holds each key of the last sync at the slot
// that sync gave it: what heldSlots' walk takes for granted.
func requireSyncedSlots(t *testing.T, d *Datapath, round int) {
	t.Helper()
	for i, k := range d.syncedPlan.keys {
		if s, ok := d.slots.byKey[k]; !ok || s != d.syncedSlots[i] {
			t.Fatalf("sync %d: key %d (%s) synced with slot %d, the table has %d (%v)", round, i, k.prefix(), d.syncedSlots[i], s, ok)
		}
	}
}

// TestPassingSteps: a trie synced in passingSteps never leaves an address without a match
// while the policy before and the one after both match it, nor matches one neither does; it
// ends holding the new set; and an old prefix before every new one goes with the first step.
func TestPassingSteps(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	randomSet := func(n int) []trieEntry {
		seen := map[trieKey]bool{}
		var out []trieEntry
		for range n {
			bits := 16 + rng.IntN(11)
			a := netip.AddrFrom4([4]byte{10, 0, byte(rng.IntN(256)), byte(rng.IntN(256))})
			p := netip.PrefixFrom(a, bits).Masked()
			if !seen[p] {
				seen[p] = true
				out = append(out, trieEntry{p, trieValue{action: policy.Return, slot: uint32(rng.IntN(2))}})
			}
		}
		slices.SortFunc(out, func(a, b trieEntry) int { return prefixOrder(a.prefix, b.prefix) })
		return out
	}
	matches := func(set map[trieKey]bool, a netip.Addr) bool {
		for bits := 16; bits <= 32; bits++ {
			if set[netip.PrefixFrom(a, bits).Masked()] {
				return true
			}
		}
		return false
	}
	setOf := func(entries []trieEntry) map[trieKey]bool {
		m := map[trieKey]bool{}
		for _, e := range entries {
			m[e.prefix] = true
		}
		return m
	}
	for round := range 300 {
		old, want := randomSet(rng.IntN(40)), randomSet(rng.IntN(40))
		put, stale := diffSorted(old, want)
		chunk := 1 + rng.IntN(4)
		before, after, cur := setOf(old), setOf(want), setOf(old)
		probes := make([]netip.Addr, 512)
		for i := range probes {
			probes[i] = netip.AddrFrom4([4]byte{10, 0, byte(rng.IntN(256)), byte(rng.IntN(256))})
		}
		check := func(step int) {
			for _, a := range probes {
				if was, will := matches(before, a), matches(after, a); was == will && matches(cur, a) != was {
					t.Fatalf("round %d, chunk %d, step %d: %s matched %v before and after the sync, %v during it",
						round, chunk, step, a, was, !was)
				}
			}
		}
		for i, s := range slices.Collect(passingSteps(put, stale, chunk)) {
			for _, e := range s.put {
				cur[e.prefix] = true
			}
			check(i)
			for _, p := range s.del {
				delete(cur, p)
			}
			check(i)
		}
		if !maps.Equal(cur, after) {
			t.Fatalf("round %d: the steps left %d prefixes, the new set has %d", round, len(cur), len(after))
		}
	}
	early := []trieEntry{{netip.MustParsePrefix("8.8.8.8/32"), trieValue{action: policy.Return}}}
	var later []trieEntry
	for i := range 10 {
		later = append(later, trieEntry{netip.PrefixFrom(netip.AddrFrom4([4]byte{11, 0, byte(i), 0}), 24), trieValue{action: policy.Return}})
	}
	put, stale := diffSorted(early, later)
	if steps := slices.Collect(passingSteps(put, stale, 2)); len(steps) != 5 || !slices.Equal(steps[0].del, stale) {
		t.Fatalf("8.8.8.8/32 replaced by ten /24s of 11/8, two at a time: %+v; want it deleted with the first two", steps)
	}
}

func TestLastAddr(t *testing.T) {
	for prefix, want := range map[string]string{
		"0.0.0.0/0": "255.255.255.255", "10.1.2.3/8": "10.255.255.255", "10.1.2.3/32": "10.1.2.3",
		"192.168.1.128/25": "192.168.1.255", "::/0": "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
		"2001:db8::/32": "2001:db8:ffff:ffff:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64": "2001:db8:1:2:ffff:ffff:ffff:ffff",
		"2001:db8:1:2:3::/100": "2001:db8:1:2:3:0:fff:ffff", "2001:db8::1/128": "2001:db8::1",
		"2001:db8:1:2:3::/63": "2001:db8:1:3:ffff:ffff:ffff:ffff",
	} {
		if got := lastAddr(netip.MustParsePrefix(prefix)); got != netip.MustParseAddr(want) {
			t.Errorf("lastAddr(%s) = %s, want %s", prefix, got, want)
		}
	}
}
