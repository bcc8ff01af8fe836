package bpf

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf/bpftest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// TestLayoutFixture: every map of the fixture of this build's layout is in the embedded object as
// it was (a change of a pinned map is a new layout, with its migration; a map added is not), and
// the shapes Inspect tells the legacy layouts apart by are those of their fixtures.
func TestLayoutFixture(t *testing.T) {
	if got := bpftest.Current(); got != Layout {
		t.Fatalf("the newest fixture is of layout %d, this build's layout is %d: copy masq_bpfel.o to bpftest/testdata/layout%d.o", got, Layout, Layout)
	}
	embedded, err := loadMasq()
	if err != nil {
		t.Fatal(err)
	}
	fixture, err := bpftest.Spec(Layout)
	if err != nil {
		t.Fatal(err)
	}
	describe := func(spec *ebpf.CollectionSpec) map[string]string {
		out := map[string]string{}
		for name, m := range spec.Maps {
			if ownMap(name) {
				continue // no layout has them
			}
			var gf btf.GoFormatter
			k, err := gf.TypeDeclaration("K", m.Key)
			if err != nil {
				t.Fatal(err)
			}
			v, err := gf.TypeDeclaration("V", m.Value)
			if err != nil {
				t.Fatal(err)
			}
			out[name] = fmt.Sprintf("%s flags %#x: %s; %s", mapShape{m.Type, m.KeySize, m.ValueSize}, m.Flags, k, v)
		}
		return out
	}
	want, got := describe(fixture), describe(embedded)
	for _, name := range slices.Sorted(maps.Keys(want)) {
		if want[name] != got[name] {
			t.Errorf("map %s changed since layout %d:\n  layout %d: %s\n  now:      %s\nA pinned layout changed: add layout %d as pkg/bpf/layout.go says",
				name, Layout, Layout, want[name], got[name], Layout+1)
		}
	}
	for _, l := range bpftest.Layouts() {
		if l >= firstDirLayout {
			continue
		}
		spec, err := bpftest.Spec(l)
		if err != nil {
			t.Fatal(err)
		}
		shapes := map[string]mapShape{}
		for name, m := range spec.Maps {
			shapes[name] = mapShape{m.Type, m.KeySize, m.ValueSize}
		}
		if l == 2 {
			maps.Copy(shapes, laterLegacyMaps)
		}
		if !maps.Equal(shapes, legacyShapes[l]) {
			t.Errorf("layout %d: the fixture's maps are %v, legacyShapes says %v", l, shapes, legacyShapes[l])
		}
	}
}

// oldFlow is a flow the programs of an older layout carried before the migration.
type oldFlow struct {
	name      string
	proto     uint8
	pod, peer netip.AddrPort
	out, back func(s, d netip.AddrPort) []byte
	// seen is the flow as the old programs translated its first packet.
	seen tuple
}

// masqFlows are masqueraded flows of every protocol and both families.
func masqFlows() []*oldFlow {
	var out []*oldFlow
	for _, fam := range families {
		for i, b := range builders(fam.v6) {
			if b.name != "tcp" && b.name != "udp" && b.name != "icmp-echo" {
				continue // the protocols every layout's programs translated
			}
			peer := ap(remote(fam.v6), 443)
			if b.name == "icmp-echo" {
				peer = ap(remote(fam.v6), 0)
			}
			out = append(out, &oldFlow{name: fam.name + "/" + b.name, proto: b.proto,
				pod: ap(pod(fam.v6, 10+i), 41000+uint16(i)), peer: peer, out: b.out, back: b.back})
		}
	}
	return out
}

// passOld runs a program of an older layout's object and requires it to pass the packet with
// valid checksums: with TC_ACT_OK, as the programs of layouts 1 and 2 did (ending the tc chain),
// or TC_ACT_UNSPEC.
func (h *harness) passOld(prog *ebpf.Program, frame []byte) []byte {
	h.t.Helper()
	ret, out := runProg(h.t, prog, frame)
	if ret != 0 && ret != tcNext {
		h.t.Fatalf("%s: verdict %d, want a pass", prog, int32(ret))
	}
	if err := verifyChecksums(out); err != nil {
		h.t.Fatalf("%s: output checksums: %v\n%s", prog, err, describe(out))
	}
	return out
}

// rawEntries counts a pinned table's entries, reading its bytes.
func rawEntries(t *testing.T, m *ebpf.Map) int {
	t.Helper()
	n := 0
	if err := walkRaw(m, func(_, _ []byte) error { n++; return nil }); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestMigrate, from every older layout: the pins its object made, with flows of every kind that
// its programs carried (masqueraded TCP, UDP and ICMP echo over both families, a host flow, an
// inbound flow), are migrated: every flow keeps its mapping through the new programs and its
// replies come back; the rule slots, counters, event counters, sweep totals and uplink carry
// over; what the old programs did after the first pass (new flows, a FIN, more packets) is
// carried by the catch-up before the swap and by Finish after it, which then removes the old
// pins.
func TestMigrate(t *testing.T) {
	for _, from := range bpftest.Layouts() {
		if from >= Layout {
			continue
		}
		t.Run(fmt.Sprintf("from-layout-%d", from), func(t *testing.T) { testMigrate(t, from) })
	}
}

func testMigrate(t *testing.T, from int) {
	root := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
	old, err := bpftest.Load(from, root, bpftest.Options{IPv6: true, Uplink: testIfindex, SNAT4: snat4, SNAT6: snat6})
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	old.NeedPrograms(t)
	h := &harness{t: t}
	flows := masqFlows()
	for _, f := range flows {
		f.seen = tupleOf(t, h.passOld(old.Egress(), f.out(f.pod, f.peer)))
		if f.seen.src.Addr() != snatFor(f.pod.Addr()) {
			t.Fatalf("%s: the old programs translated to %s", f.name, f.seen)
		}
		if back := tupleOf(t, h.passOld(old.Ingress(), f.back(f.seen.dst, f.seen.src))); back.dst != f.pod {
			t.Fatalf("%s: the old programs translated the reply to %s", f.name, back)
		}
	}
	host := udpPacket(ap(snat4, 40000), ap(remote4, 123), nil)
	h.passOld(old.Egress(), host)
	inbound := tcpPacket(ap(remote4, 5555), ap(pod4(90), 8080), tcpSYN, nil)
	h.passOld(old.Ingress(), inbound)
	if err := old.Map("sweep_stats").Put(uint32(unix.IPPROTO_UDP), uint64(7)); err != nil {
		t.Fatal(err)
	}
	oldEntries := rawEntries(t, old.Map("nat_v4")) + rawEntries(t, old.Map("nat_v6"))

	pins, err := Inspect(root)
	if err != nil {
		t.Fatal(err)
	}
	if pins.Current || len(pins.Sources) != 1 || pins.Sources[0].Layout != from || pins.Sources[0].Dir != bpftest.PinDir(root, from) {
		t.Fatalf("Inspect found %+v, want layout %d's pins in %s", pins, from, bpftest.PinDir(root, from))
	}
	dp, err := Load(LoadOptions{PinPath: LayoutDir(root), NATEntries: 1 << 12, MaxRules: 64})
	if err != nil {
		t.Fatal(err)
	}
	defer dp.Close()
	mig, err := dp.Migrate(pins.Sources)
	if err != nil {
		t.Fatal(err)
	}
	if got := mig.Entries[masqMapNatV4] + mig.Entries[masqMapNatV6]; got != oldEntries {
		t.Errorf("the first pass carried %d NAT entries, the old tables hold %d", got, oldEntries)
	}

	// Until the swap the old programs run: new flows, a FIN, and more packets to count, during
	// the first pass (caught up right before the swap) and after the catch-up (by Finish).
	udpFlow := func(name string, i int) *oldFlow {
		return &oldFlow{name: name, proto: unix.IPPROTO_UDP, pod: ap(pod4(i), 6000), peer: ap(remote4, 53),
			out:  func(s, d netip.AddrPort) []byte { return udpPacket(s, d, nil) },
			back: func(s, d netip.AddrPort) []byte { return udpPacket(s, d, nil) }}
	}
	late, later := udpFlow("late udp", 60), udpFlow("later udp", 61)
	late.seen = tupleOf(t, h.passOld(old.Egress(), late.out(late.pod, late.peer)))
	tcp4 := flows[0]
	h.passOld(old.Egress(), tcpPacket(tcp4.pod, tcp4.peer, tcpFIN|tcpACK, nil))

	// The agent writes its policy, catches up, and swaps the programs.
	p := defaultPolicy(true)
	if err := dp.SyncPolicy(p); err != nil {
		t.Fatal(err)
	}
	if err := mig.CatchUp(dp); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := dp.LookupNAT(Egress, unix.IPPROTO_UDP, late.pod, late.peer); err != nil || !ok {
		t.Errorf("a flow the old programs opened during the first pass is missing after the catch-up: %v %v", ok, err)
	}
	later.seen = tupleOf(t, h.passOld(old.Egress(), later.out(later.pod, later.peer)))
	if u, ok, err := dp.Uplink(testIfindex); err != nil || !ok || u != (Uplink{IPv4: snat4, IPv6: snat6}) {
		t.Errorf("uplink after the migration: %+v %v %v", u, ok, err)
	}
	if err := mig.Finish(dp); err != nil {
		t.Fatal(err)
	}
	if got := pinNames(t, root); !slices.Equal(got, []string{filepath.Base(LayoutDir(root))}) {
		t.Errorf("after Finish the root holds %v, want only %s", got, filepath.Base(LayoutDir(root)))
	}
	if pins, err := Inspect(root); err != nil || !pins.Current || len(pins.Sources) != 0 {
		t.Errorf("after Finish Inspect finds %+v, %v", pins, err)
	}

	// Counters: the outbound rule counted the old programs' masqueraded packets, before and
	// after the first pass.
	stats, err := dp.RuleStats()
	if err != nil {
		t.Fatal(err)
	}
	wantPackets := map[policy.Family]uint64{policy.IPv4: 3 + 1 + 1 + 1, policy.IPv6: 3} // 3 flows, late, FIN, later
	for _, s := range stats {
		if s.Rule.Origin == policy.OriginOutbound && s.Packets != wantPackets[s.Rule.Family] {
			t.Errorf("%s outbound rule: %d packets, want %d", s.Rule.Family, s.Packets, wantPackets[s.Rule.Family])
		}
	}
	if ev, err := dp.EventCounts(); err != nil || ev[Event(masqEventEV_NEW_MASQ)] != 8 || ev[Event(masqEventEV_HOST_FLOW)] != 1 || ev[Event(masqEventEV_INBOUND_FLOW)] != 1 {
		t.Errorf("events after the migration: %v %v; want 8 new mappings, a host flow, an inbound flow", ev, err)
	}
	if swept, err := dp.SweptEntries(); err != nil || swept[unix.IPPROTO_UDP] != 7 {
		t.Errorf("sweep totals %v %v, want the 7 UDP entries the old agent swept", swept, err)
	}

	if e, ok, err := dp.LookupNAT(Egress, unix.IPPROTO_TCP, tcp4.pod, tcp4.peer); err != nil || !ok || e.Flags&FlagFIN == 0 {
		t.Errorf("the FIN the old programs saw after the first pass: entry %+v %v %v", e, ok, err)
	}
	// A flow both of whose halves carried a packet is confirmed, replied and opened from its egress
	// half; a flow that only went one way is not confirmed (layouts before 4 had one table).
	for _, f := range flows {
		e, ok, err := dp.LookupNAT(Egress, f.proto, f.pod, f.peer)
		if err != nil || !ok || e.Table != TableConfirmed || e.Flags&(FlagOrig|FlagReplied) != FlagOrig|FlagReplied {
			t.Errorf("%s: the old two-way flow became %+v (%v %v), want it confirmed, replied, opened this way", f.name, e, ok, err)
		}
	}
	for _, f := range []*oldFlow{late, later} {
		if e, ok, err := dp.LookupNAT(Egress, f.proto, f.pod, f.peer); err != nil || !ok || e.Table != TableUnreplied || e.Flags != FlagOrig {
			t.Errorf("%s: the old one-way flow became %+v (%v %v), want it unconfirmed", f.name, e, ok, err)
		}
	}

	// Every flow through the new programs: the same mapping, replies back to the pod (the TCP
	// flow's SYN reopens it).
	h.dp = dp
	for _, f := range append(flows, late, later) {
		if got := tupleOf(t, h.mustPass(dp.Egress(), f.out(f.pod, f.peer))); got != f.seen {
			t.Errorf("%s: the new programs translate to %s, the old ones did to %s", f.name, got, f.seen)
		}
		if back := tupleOf(t, h.mustPass(dp.Ingress(), f.back(f.seen.dst, f.seen.src))); back.dst != f.pod {
			t.Errorf("%s: the reply arrives as %s, want it toward %s", f.name, back, f.pod)
		}
	}
	if out := h.mustPass(dp.Egress(), host); tupleOf(t, out).src != ap(snat4, 40000) {
		t.Errorf("the host flow lost its port: %s", tupleOf(t, out))
	}
	if e, ok, err := dp.LookupNAT(Egress, unix.IPPROTO_TCP, ap(pod4(90), 8080), ap(remote4, 5555)); err != nil || !ok || e.Kind != KindInbound {
		t.Errorf("the inbound flow: %+v %v %v", e, ok, err)
	}
	if ev := h.events(); ev[Event(masqEventEV_NEW_MASQ)] != 8 {
		t.Errorf("the new programs made %d mappings since, want none", ev[Event(masqEventEV_NEW_MASQ)]-8)
	}
}

// upgradeOver does what the agent does over pins: loads this layout's maps, migrates pins' sources,
// syncs the default policy and finishes (no programs to swap in a test run).
func upgradeOver(t *testing.T, root string, pins Pins) *Datapath {
	t.Helper()
	dp, err := Load(LoadOptions{PinPath: LayoutDir(root), NATEntries: 1 << 12, MaxRules: 64})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dp.Close() })
	mig, err := dp.Migrate(pins.Sources)
	if err != nil {
		t.Fatal(err)
	}
	if err := dp.SyncPolicy(defaultPolicy(true)); err != nil {
		t.Fatal(err)
	}
	if err := mig.Finish(dp); err != nil {
		t.Fatal(err)
	}
	return dp
}

// TestMigrateAgain: a migration interrupted after its first pass (the agent killed before the
// swap) is done again by the next agent over the maps the first one made, with the same result.
func TestMigrateAgain(t *testing.T) {
	root := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
	old, err := bpftest.Load(2, root, bpftest.Options{Uplink: testIfindex, SNAT4: snat4})
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	old.NeedPrograms(t)
	h := &harness{t: t}
	flows := masqFlows()[:3] // IPv4
	for _, f := range flows {
		f.seen = tupleOf(t, h.passOld(old.Egress(), f.out(f.pod, f.peer)))
	}
	for range 2 {
		pins, err := Inspect(root)
		if err != nil {
			t.Fatal(err)
		}
		dp, err := Load(LoadOptions{PinPath: LayoutDir(root), NATEntries: 1 << 12, MaxRules: 64})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := dp.Migrate(pins.Sources); err != nil {
			t.Fatal(err)
		}
		dp.Close() // killed
	}
	pins, err := Inspect(root)
	if err != nil || !pins.Current || len(pins.Sources) != 1 {
		t.Fatalf("after two interrupted migrations: %+v %v", pins, err)
	}
	dp := upgradeOver(t, root, pins)
	if n := rawEntries(t, dp.objs.NatV4) + rawEntries(t, dp.objs.NatNewV4); n != 2*len(flows) {
		t.Errorf("%d entries after migrating three times, want the flows' %d", n, 2*len(flows))
	}
	h.dp = dp
	for _, f := range flows {
		if got := tupleOf(t, h.mustPass(dp.Egress(), f.out(f.pod, f.peer))); got != f.seen {
			t.Errorf("%s: translated to %s, first to %s", f.name, got, f.seen)
		}
	}
	if rules, err := dp.InstalledRules(); err != nil || len(rules) != 7 {
		t.Errorf("installed rules %v %v, want the default policy's 7", rules, err)
	}
}

// TestMigrateAfterRollback: an agent of layout 2 ran after this layout's (a rollback), over maps
// of its own at the root, while this layout's stayed in v3 untouched; rolled forward again, the
// agent merges them. A flow idle through the rollback keeps its v3 mapping; a flow the old agent
// mapped anew keeps that new mapping (the old programs' entries win), and its stale v3 half is
// dropped; a flow only the old agent saw is there; and the v3 flows' slots are renamed to the
// slots their rules have in the old agent's assignment.
func TestMigrateAfterRollback(t *testing.T) {
	root := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
	// Layout 3 first, with a policy whose extra rule takes slot 0.
	dp, err := Load(LoadOptions{PinPath: LayoutDir(root), NATEntries: 1 << 12, MaxRules: 64})
	if err != nil {
		t.Fatal(err)
	}
	withExtra := compilePolicy(t, "masqueradeCIDRs: [203.0.113.0/24]\n")
	if err := dp.SyncPolicy(withExtra); err != nil {
		t.Fatal(err)
	}
	if _, err := dp.SetUplink(testIfindex, Uplink{IPv4: snat4}); err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, dp: dp}
	idle := ap(pod4(1), 1111)
	remapped := ap(pod4(2), 2222)
	peer := ap(remote4, 443)
	idleSeen := tupleOf(t, h.mustPass(dp.Egress(), udpPacket(idle, peer, nil)))
	staleSeen := tupleOf(t, h.mustPass(dp.Egress(), udpPacket(remapped, peer, nil)))
	idleEntry, _, _ := dp.LookupNAT(Egress, unix.IPPROTO_UDP, idle, peer)
	dp.Close()

	// The rollback: a layout-2 agent with maps of its own, and the default policy.
	old, err := bpftest.Load(2, root, bpftest.Options{Uplink: testIfindex, SNAT4: snat4})
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	old.NeedPrograms(t)
	var remappedSeen tuple
	for {
		remappedSeen = tupleOf(t, h.passOld(old.Egress(), udpPacket(remapped, peer, nil)))
		if remappedSeen != staleSeen {
			break
		}
		// The same random port by chance: another flow shows the conflict.
		old.Map("nat_v4").Delete(natKey(Egress, unix.IPPROTO_UDP, remapped, peer))
	}
	onlyOld := ap(pod4(3), 3333)
	onlyOldSeen := tupleOf(t, h.passOld(old.Egress(), udpPacket(onlyOld, peer, nil)))

	pins, err := Inspect(root)
	if err != nil || !pins.Current || len(pins.Sources) != 1 || pins.Sources[0].Layout != 2 {
		t.Fatalf("after the rollback Inspect finds %+v, %v", pins, err)
	}
	dp = upgradeOver(t, root, pins)
	h.dp = dp
	for _, c := range []struct {
		name string
		pod  netip.AddrPort
		want tuple
	}{{"idle through the rollback", idle, idleSeen}, {"mapped anew by the old agent", remapped, remappedSeen},
		{"only the old agent's", onlyOld, onlyOldSeen}} {
		if got := tupleOf(t, h.mustPass(dp.Egress(), udpPacket(c.pod, peer, nil))); got != c.want {
			t.Errorf("%s: translated to %s, want %s", c.name, got, c.want)
		}
	}
	// The stale half of the remapped flow is gone: nothing answers at its old port.
	if _, ok, _ := dp.LookupNAT(Ingress, unix.IPPROTO_UDP, peer, staleSeen.src); ok {
		t.Errorf("the remapped flow's stale half (port %d) is still there", staleSeen.src.Port())
	}
	// The idle flow's slot was the outbound rule's of layout 3's assignment (after the extra
	// rule); it is now that rule's slot in the layout-2 agent's.
	e, ok, err := dp.LookupNAT(Egress, unix.IPPROTO_UDP, idle, peer)
	if err != nil || !ok {
		t.Fatalf("idle flow: %v %v", ok, err)
	}
	rules, err := dp.InstalledRules()
	if err != nil {
		t.Fatal(err)
	}
	outbound := noSlot
	for _, r := range rules {
		if r.Family == policy.IPv4 && r.Origin == policy.OriginOutbound {
			outbound = r.Slot
		}
	}
	if idleEntry.Slot == outbound || e.Slot != outbound {
		t.Errorf("the idle flow counted into slot %d, now %d; the outbound rule's slot is %d", idleEntry.Slot, e.Slot, outbound)
	}
}

func compilePolicy(t *testing.T, cfg string) *policy.Policy {
	t.Helper()
	c, err := config.Parse([]byte(cfg), config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return policy.Compile(c, policy.Options{RandomFully: true})
}

// TestInspectRefuses: pins of a layout this agent does not know are refused, naming them, and
// left as they were; what Inspect may accept, it does.
func TestInspectRefuses(t *testing.T) {
	testutil.RequirePrivileged(t)
	refuse := func(t *testing.T, root, want string) {
		t.Helper()
		before := pinsUnder(t, root)
		_, err := Inspect(root)
		if !errors.Is(err, ErrUnknownLayout) || !strings.Contains(err.Error(), want) {
			t.Fatalf("Inspect: %v, want ErrUnknownLayout saying %q", err, want)
		}
		if after := pinsUnder(t, root); !slices.Equal(before, after) {
			t.Errorf("Inspect changed the pins: %v, then %v", before, after)
		}
	}
	t.Run("newer layout", func(t *testing.T) {
		root := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
		newer, err := bpftest.Newer(root, bpftest.Options{})
		if err != nil {
			t.Fatal(err)
		}
		newer.Close()
		refuse(t, root, fmt.Sprintf("holds layout %d, newer than this agent's %d", Layout+1, Layout))
	})
	t.Run("legacy map of no layout", func(t *testing.T) {
		root := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
		pinMap(t, filepath.Join(root, "nat_v4"), &ebpf.MapSpec{Type: ebpf.LRUHash, KeySize: 16, ValueSize: 48, MaxEntries: 16})
		refuse(t, root, "nat_v4 is a LRUHash with 16-byte keys and 48-byte values, which no layout's nat_v4 is")
	})
	t.Run("current directory with a foreign map", func(t *testing.T) {
		root := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
		pinMap(t, filepath.Join(LayoutDir(root), "nat_v4"), &ebpf.MapSpec{Type: ebpf.LRUHash, KeySize: 16, ValueSize: 40, MaxEntries: 16})
		refuse(t, root, fmt.Sprintf("nat_v4 is a LRUHash with 16-byte keys and 40-byte values, not what layout %d has", Layout))
	})
	t.Run("record of another layout", func(t *testing.T) {
		root := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
		dp, err := Load(LoadOptions{PinPath: LayoutDir(root), NATEntries: 16, MaxRules: 8})
		if err != nil {
			t.Fatal(err)
		}
		rec := layoutRecord()
		rec.Version = 9
		if err := dp.objs.Layout.Put(uint32(0), rec); err != nil {
			t.Fatal(err)
		}
		dp.Close()
		refuse(t, root, fmt.Sprintf(`the layout record says "ip-masq-agent", layout 9; want "ip-masq-agent", layout %d`, Layout))
	})
	t.Run("a directory of no layout", func(t *testing.T) {
		root := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
		if err := os.MkdirAll(filepath.Join(root, "v2"), 0o700); err != nil {
			t.Fatal(err)
		}
		refuse(t, root, "layout 2 never had a directory")
	})
	t.Run("accepted", func(t *testing.T) {
		root := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
		dp, err := Load(LoadOptions{PinPath: LayoutDir(root), NATEntries: 16, MaxRules: 8})
		if err != nil {
			t.Fatal(err)
		}
		dp.Close()
		// The record's pin removed by hand: the maps still say what they are.
		if err := os.Remove(filepath.Join(LayoutDir(root), masqMapLayout)); err != nil {
			t.Fatal(err)
		}
		// A staging directory a crash left, and the links' directory.
		for _, d := range []string{stagingDir(LayoutDir(root)), filepath.Join(root, "links")} {
			if err := os.Mkdir(d, 0o700); err != nil {
				t.Fatal(err)
			}
		}
		// A map a later build of this layout added.
		later := filepath.Join(LayoutDir(root), "later_map")
		pinMap(t, later, &ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
		pins, err := Inspect(root)
		if err != nil || !pins.Current || len(pins.Sources) != 0 {
			t.Fatalf("Inspect: %+v %v", pins, err)
		}
		dp, err = Load(LoadOptions{PinPath: LayoutDir(root), NATEntries: 16, MaxRules: 8})
		if err != nil {
			t.Fatal(err)
		}
		defer dp.Close()
		m, err := ebpf.LoadPinnedMap(filepath.Join(LayoutDir(root), masqMapLayout), nil)
		if err != nil {
			t.Fatalf("the record was not pinned again: %v", err)
		}
		defer m.Close()
		if err := checkRecord(m, Layout); err != nil {
			t.Errorf("the record written again: %v", err)
		}
		if _, err := os.Stat(later); err != nil {
			t.Errorf("the later build's map: %v", err)
		}
	})
}

// TestLayoutDirMadeWhole: a layout directory appears with every map and its record, and a
// staging directory left by a crash does not keep it from being made.
func TestLayoutDirMadeWhole(t *testing.T) {
	root := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
	staging := stagingDir(LayoutDir(root))
	pinMap(t, filepath.Join(staging, "nat_v4"), &ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	dp, err := Load(LoadOptions{PinPath: LayoutDir(root), NATEntries: 16, MaxRules: 8})
	if err != nil {
		t.Fatal(err)
	}
	dp.Close()
	if got, want := pinNames(t, LayoutDir(root)), MapNames(); !slices.Equal(got, want) {
		t.Errorf("pins %v, want %v", got, want)
	}
	if _, err := os.Stat(staging); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the staging directory is left: %v", err)
	}
}

func pinMap(t *testing.T, path string, spec *ebpf.MapSpec) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	m, err := ebpf.NewMap(spec)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Pin(path); err != nil {
		t.Fatal(err)
	}
}

// pinsUnder is bpftest.PinState, failing the test on errors.
func pinsUnder(t *testing.T, dir string) []string {
	t.Helper()
	st, err := bpftest.PinState(dir)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// pinNames lists the names in dir, sorted.
func pinNames(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}

// outboundPackets are the packets the IPv4 outbound rule counted.
func outboundPackets(t *testing.T, dp *Datapath) uint64 {
	t.Helper()
	rules, err := dp.InstalledRules()
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rules {
		if r.Family == policy.IPv4 && r.Origin == policy.OriginOutbound {
			return r.Packets
		}
	}
	t.Fatal("no outbound rule installed")
	return 0
}

// TestMigrateAfterTheSwap: an agent killed after it swapped the programs and before it finished
// the migration leaves the old maps frozen and this layout's in use. The next agent takes the
// new maps for the live ones: a flow the new programs opened keeps its mapping and its replies,
// even where the frozen maps hold another pod's flow under the same reply key (its port then
// free again for the new programs), and the counters keep what the new programs counted. A
// flow held through it all keeps its mapping, and Finish leaves this layout's maps alone.
func TestMigrateAfterTheSwap(t *testing.T) {
	root := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
	from := Layout - 1
	old, err := bpftest.Load(from, root, bpftest.Options{Uplink: testIfindex, SNAT4: snat4})
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	old.NeedPrograms(t)
	h := &harness{t: t}
	peer := ap(remote4, 53)
	held := ap(pod4(1), 1000)
	heldSeen := tupleOf(t, h.passOld(old.Egress(), udpPacket(held, peer, nil)))
	h.passOld(old.Ingress(), udpPacket(peer, heldSeen.src, nil))

	// The first agent: the first pass, the catch-up, the mark, the swap.
	pins, err := Inspect(root)
	if err != nil {
		t.Fatal(err)
	}
	lopts := LoadOptions{PinPath: LayoutDir(root), NATEntries: 1 << 12, MaxRules: 64}
	dp, err := Load(lopts)
	if err != nil {
		t.Fatal(err)
	}
	mig, err := dp.Migrate(pins.Sources)
	if err != nil {
		t.Fatal(err)
	}
	if mig.Resumed() {
		t.Error("a migration nobody swapped yet is resumed")
	}
	if err := dp.SyncPolicy(defaultPolicy(true)); err != nil {
		t.Fatal(err)
	}
	if err := mig.CatchUp(dp); err != nil {
		t.Fatal(err)
	}
	if err := mig.Swapping(); err != nil {
		t.Fatal(err)
	}
	// Right before the swap, the old programs open a flow no pass carries.
	stale := ap(pod4(2), 2000)
	staleSeen := tupleOf(t, h.passOld(old.Egress(), udpPacket(stale, peer, nil)))
	// Swapped: the new programs, whose only port is that flow's, map another pod's flow to
	// the peer there, which the frozen maps hold for the first pod.
	c, err := config.Parse(nil, config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	port := staleSeen.src.Port()
	onePort := policy.Compile(c, policy.Options{RandomFully: true, ToPorts: policy.PortRanges{{First: port, Last: port}}})
	if err := dp.SyncPolicy(onePort); err != nil {
		t.Fatal(err)
	}
	h.dp = dp
	live := ap(pod4(3), 3000)
	liveSeen := tupleOf(t, h.mustPass(dp.Egress(), udpPacket(live, peer, nil)))
	if liveSeen.src != staleSeen.src {
		t.Fatalf("the new programs mapped the new flow to %s, want the frozen flow's %s", liveSeen.src, staleSeen.src)
	}
	for range 3 {
		h.mustPass(dp.Egress(), udpPacket(live, peer, nil))
	}
	// Another pod finds the one port taken: a drop only the new programs counted.
	if ret, _ := h.run(t, dp.Egress(), udpPacket(ap(pod4(4), 4000), peer, nil)); ret != tcActShot {
		t.Fatalf("a second flow on the one port: verdict %d, want a drop", int32(ret))
	}
	counted := outboundPackets(t, dp)
	events := eventCounts(t, dp)
	if events[EventDropNoPort] == 0 {
		t.Fatalf("the new programs counted no drop_no_port: %v", events)
	}
	dp.Close() // killed before Finish

	// The next agent, over the same pins.
	pins, err = Inspect(root)
	if err != nil || !pins.Current || len(pins.Sources) != 1 {
		t.Fatalf("after the kill Inspect finds %+v, %v", pins, err)
	}
	dp, err = Load(lopts)
	if err != nil {
		t.Fatal(err)
	}
	defer dp.Close()
	if mig, err = dp.Migrate(pins.Sources); err != nil {
		t.Fatal(err)
	}
	if !mig.Resumed() {
		t.Error("the migration of an agent killed after the swap is not resumed")
	}
	if err := dp.SyncPolicy(onePort); err != nil {
		t.Fatal(err)
	}
	if got := outboundPackets(t, dp); got != counted {
		t.Errorf("the outbound rule counted %d packets after the second agent's first pass, %d before", got, counted)
	}
	countersGrew(t, "the second agent's first pass", events, eventCounts(t, dp))
	h.dp = dp
	if back := tupleOf(t, h.mustPass(dp.Ingress(), udpPacket(peer, liveSeen.src, nil))); back.dst != live {
		t.Errorf("the reply to the new programs' flow goes to %s, want its pod %s (the frozen flow's is %s)", back.dst, live, stale)
	}
	if got := tupleOf(t, h.mustPass(dp.Egress(), udpPacket(live, peer, nil))); got != liveSeen {
		t.Errorf("the new programs' flow now leaves as %s, before as %s", got, liveSeen)
	}
	if got := tupleOf(t, h.mustPass(dp.Egress(), udpPacket(held, peer, nil))); got != heldSeen {
		t.Errorf("the held flow now leaves as %s, before as %s", got, heldSeen)
	}
	if err := mig.Finish(dp); err != nil {
		t.Fatal(err)
	}
	if got := pinNames(t, root); !slices.Equal(got, []string{filepath.Base(LayoutDir(root))}) {
		t.Errorf("after Finish the root holds %v, want only %s", got, filepath.Base(LayoutDir(root)))
	}
	if got := outboundPackets(t, dp); got != counted+2 {
		t.Errorf("the outbound rule counted %d packets after Finish, want %d", got, counted+2)
	}
	countersGrew(t, "Finish", events, eventCounts(t, dp))
}

func eventCounts(t *testing.T, dp *Datapath) map[Event]uint64 {
	t.Helper()
	n, err := dp.EventCounts()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// countersGrew fails the test where a counter of after is below before's: a counter that goes
// back breaks Prometheus' rate.
func countersGrew(t *testing.T, what string, before, after map[Event]uint64) {
	t.Helper()
	if len(before) == 0 {
		t.Fatal("no event counted before")
	}
	for e, n := range before {
		if after[e] < n {
			t.Errorf("after %s event %s counts %d, before %d", what, e, after[e], n)
		}
	}
}

// TestOpenReplacesNewer: Open refuses the pins of a newer layout, changing nothing; with
// ReplaceNewer it opens this layout's maps empty beside them, carries nothing of them, and
// Finish removes them.
func TestOpenReplacesNewer(t *testing.T) {
	root := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
	newer, err := bpftest.Newer(root, bpftest.Options{Uplink: testIfindex, SNAT4: snat4})
	if err != nil {
		t.Fatal(err)
	}
	defer newer.Close()
	newer.NeedPrograms(t)
	h := &harness{t: t}
	h.passOld(newer.Egress(), udpPacket(ap(pod4(1), 1000), ap(remote4, 53), nil))
	before := pinsUnder(t, root)
	p := defaultPolicy(true)
	if _, err := Open(root, OpenOptions{Policy: p}); !errors.Is(err, ErrUnknownLayout) {
		t.Fatalf("Open over a newer layout: %v, want ErrUnknownLayout", err)
	}
	if after := pinsUnder(t, root); !slices.Equal(before, after) {
		t.Fatalf("the refusal changed the pins:\nbefore %v\nafter  %v", before, after)
	}
	opened, err := Open(root, OpenOptions{Policy: p, ReplaceNewer: true})
	if err != nil {
		t.Fatal(err)
	}
	defer opened.Close()
	newerDir := filepath.Join(root, fmt.Sprintf("v%d", Layout+1))
	if len(opened.Replaced) != 1 || opened.Replaced[0].Dir != newerDir || opened.Migration == nil {
		t.Fatalf("replaced %v, migration %v; want %s replaced", opened.Replaced, opened.Migration, newerDir)
	}
	if n := rawEntries(t, opened.objs.NatV4) + rawEntries(t, opened.objs.NatNewV4); n != 0 {
		t.Errorf("%d NAT entries carried from a layout this build cannot read", n)
	}
	if err := opened.SyncPolicy(p); err != nil {
		t.Fatal(err)
	}
	if err := opened.Migration.Swapping(); err != nil {
		t.Fatal(err)
	}
	if err := opened.Migration.Finish(opened.Datapath); err != nil {
		t.Fatal(err)
	}
	if got := pinNames(t, root); !slices.Equal(got, []string{filepath.Base(LayoutDir(root))}) {
		t.Errorf("after Finish the root holds %v, want only %s", got, filepath.Base(LayoutDir(root)))
	}
}

// TestOpenAddsMapsOfItsLayout: a new map is no new layout. What an earlier build of this layout
// pinned (its fixture, which lacks the maps added since, such as inbound_v4/v6 and
// frag_held_v4/v6), at the sizes this build asks for, is reused as it is: nothing is migrated or
// set aside, the maps it lacks are created beside its pins, and every flow its programs made
// keeps its mapping through this build's programs.
func TestOpenAddsMapsOfItsLayout(t *testing.T) {
	root := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
	oopts := OpenOptions{NATEntries: 1 << 12, FragEntries: 256, MaxRules: 64, Policy: defaultPolicy(true)}
	lopts, err := oopts.loadOptions(Pins{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	spec, err := lopts.withDefaults().spec()
	if err != nil {
		t.Fatal(err)
	}
	sizes := map[string]uint32{}
	for name, m := range spec.Maps {
		sizes[name] = m.MaxEntries
	}
	old, err := bpftest.Load(Layout, root, bpftest.Options{IPv6: true, Uplink: testIfindex, SNAT4: snat4, SNAT6: snat6, Sizes: sizes})
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	old.NeedPrograms(t)
	var added []string
	for _, name := range MapNames() {
		if _, ok := old.Coll.Maps[name]; !ok {
			added = append(added, name)
		}
	}
	t.Logf("maps this build adds to layout %d's fixture: %v", Layout, added)

	h := &harness{t: t}
	flows := masqFlows()
	for _, f := range flows {
		f.seen = tupleOf(t, h.passOld(old.Egress(), f.out(f.pod, f.peer)))
		if back := tupleOf(t, h.passOld(old.Ingress(), f.back(f.seen.dst, f.seen.src))); back.dst != f.pod {
			t.Fatalf("%s: the old programs translated the reply to %s", f.name, back)
		}
	}

	opened, err := Open(root, oopts)
	if err != nil {
		t.Fatal(err)
	}
	defer opened.Close()
	if len(opened.Resized) > 0 || opened.Migration != nil {
		t.Fatalf("Open replaced %v and migrated %v, want the fixture's maps reused as they are", opened.Resized, opened.Migration)
	}
	if got, want := pinNames(t, LayoutDir(root)), MapNames(); !slices.Equal(got, want) {
		t.Errorf("pins %v, want every map of this build: %v", got, want)
	}
	if err := opened.SyncPolicy(defaultPolicy(true)); err != nil {
		t.Fatal(err)
	}
	h.dp = opened.Datapath
	for _, f := range flows {
		if got := tupleOf(t, h.mustPass(opened.Egress(), f.out(f.pod, f.peer))); got != f.seen {
			t.Errorf("%s: the new programs translate to %s, the old ones did to %s", f.name, got, f.seen)
		}
		if back := tupleOf(t, h.mustPass(opened.Ingress(), f.back(f.seen.dst, f.seen.src))); back.dst != f.pod {
			t.Errorf("%s: the reply arrives as %s, want it toward %s", f.name, back, f.pod)
		}
	}
	if ev := h.events(); ev[Event(masqEventEV_NEW_MASQ)] != uint64(len(flows)) {
		t.Errorf("%d mappings in all, want the old programs' %d and none since", ev[Event(masqEventEV_NEW_MASQ)], len(flows))
	}
}
