package bpf

import (
	"errors"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// TestReplaceMismatchedPins: CheckPins names exactly the pinned maps whose size changed; with
// their pins removed, Load replaces those maps and keeps the flows of the others.
func TestReplaceMismatchedPins(t *testing.T) {
	// A directory of its own, as the agent uses: the bpffs root holds files of the kernel's.
	dir := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	small := LoadOptions{PinPath: dir, NATEntries: 1 << 12, NATEntriesV6: 1 << 6}
	first, err := Load(small)
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, dp: first}
	if err := first.SyncPolicy(defaultPolicy(true)); err != nil {
		t.Fatal(err)
	}
	if _, err := first.SetUplink(testIfindex, Uplink{IPv4: snat4, IPv6: snat6}); err != nil {
		t.Fatal(err)
	}
	if got := first.Maps()["nat_v6"].MaxEntries(); got != 1<<6 {
		t.Fatalf("nat_v6 holds %d entries, want the NATEntriesV6 given (64)", got)
	}
	flow4, flow6 := ap(pod4(7), 4000), ap(pod6(7), 4000)
	// Two-way flows, so that they are in nat_v4 and nat_v6 (confirmed).
	for _, f := range [][2]netip.AddrPort{{flow4, ap(remote4, 53)}, {flow6, ap(remote6, 53)}} {
		nat := tupleOf(t, h.mustPass(first.Egress(), udpPacket(f[0], f[1], nil))).src
		h.mustPass(first.Ingress(), udpPacket(f[1], nat, nil))
		h.mustPass(first.Egress(), udpPacket(f[0], f[1], nil))
		if e, ok, err := first.LookupNAT(Egress, unix.IPPROTO_UDP, f[0], f[1]); err != nil || !ok || e.Table != TableConfirmed {
			t.Fatalf("flow %s not confirmed: %+v %v %v", f[0], e, ok, err)
		}
	}
	first.Close()

	if mm, err := CheckPins(small); err != nil || len(mm) != 0 {
		t.Fatalf("the same options: mismatches %v, %v; want none", mm, err)
	}
	bigger := small
	bigger.NATEntriesV6 = 1 << 12
	mm, err := CheckPins(bigger)
	if err != nil {
		t.Fatal(err)
	}
	want := []PinMismatch{{Map: "nat_new_v6", Reason: "MaxEntries: 1024 changed to 2048"}, {Map: "nat_v6", Reason: "MaxEntries: 64 changed to 4096"}}
	if !slices.Equal(mm, want) {
		t.Fatalf("mismatches %+v, want %+v: the IPv6 flow tables with their sizes", mm, want)
	}
	if _, err := Load(bigger); !errors.Is(err, ebpf.ErrMapIncompatible) {
		t.Fatalf("load over a mismatched pin: %v, want ErrMapIncompatible", err)
	}
	var names []string
	for _, m := range mm {
		names = append(names, m.Map)
	}
	if err := RemovePins(dir, names...); err != nil {
		t.Fatal(err)
	}
	second, err := Load(bigger)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	if got := second.Maps()["nat_v6"].MaxEntries(); got != 1<<12 {
		t.Fatalf("replaced nat_v6 holds %d entries, want 4096", got)
	}
	if _, ok, err := second.LookupNAT(Egress, unix.IPPROTO_UDP, flow4, ap(remote4, 53)); err != nil || !ok {
		t.Fatalf("the IPv4 flow did not survive the replacement of nat_v6: %v %v", ok, err)
	}
	if _, ok, err := second.LookupNAT(Egress, unix.IPPROTO_UDP, flow6, ap(remote6, 53)); err != nil || ok {
		t.Fatalf("the IPv6 flow survived in a new table: %v %v", ok, err)
	}
	pinned, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range pinned {
		got = append(got, e.Name())
	}
	if want := MapNames(); !slices.Equal(got, want) {
		t.Fatalf("pins %v, want every map %v", got, want)
	}
	if err := RemovePins(dir, "nat_v6", "nat_v6"); err != nil {
		t.Fatalf("removing a pin twice: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "nat_v6")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("nat_v6 still pinned: %v", err)
	}
}

// TestOpenPinnedReadOnly: a read-only reader reads rules and flows and cannot write.
func TestOpenPinnedReadOnly(t *testing.T) {
	dir := testutil.MountBPFFS(t)
	dp, err := Load(LoadOptions{PinPath: dir, NATEntries: 1 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer dp.Close()
	h := &harness{t: t, dp: dp}
	if err := dp.SyncPolicy(defaultPolicy(true)); err != nil {
		t.Fatal(err)
	}
	if _, err := dp.SetUplink(testIfindex, Uplink{IPv4: snat4}); err != nil {
		t.Fatal(err)
	}
	h.mustPass(dp.Egress(), udpPacket(ap(pod4(1), 1000), ap(remote4, 53), nil))

	r, err := OpenPinnedReadOnly(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	rules, err := r.InstalledRules()
	if err != nil || len(rules) == 0 {
		t.Fatalf("installed rules %v, %v", rules, err)
	}
	n := 0
	if err := r.NATEntries(policy.IPv4, func(NATEntry) bool { n++; return true }); err != nil || n != 2 {
		t.Fatalf("%d entries (%v), want the flow's 2", n, err)
	}
	if _, err := r.SetUplink(testIfindex, Uplink{IPv4: netip.MustParseAddr("192.0.2.99")}); err == nil {
		t.Fatal("a read-only reader wrote uplink_snat")
	}
	if u, _, err := dp.Uplink(testIfindex); err != nil || u.IPv4 != snat4 {
		t.Fatalf("uplink after the refused write: %v %v", u, err)
	}
}

// TestRefreshRepairsDrift: a trie entry removed behind the datapath's back comes back, with its
// rule's counter slot, with the next sync after Refresh, and only then.
func TestRefreshRepairsDrift(t *testing.T) {
	p := defaultPolicy(true)
	h := newHarness(t, p, LoadOptions{})
	dst := ap(netip.MustParseAddr("10.9.9.9"), 53)
	if out := tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(ap(pod4(1), 1000), dst, nil))); out.src.Addr() != pod4(1) {
		t.Fatalf("10/8 masqueraded before the drift: %v", out)
	}
	// Someone deletes 10.0.0.0/8 from the non-masquerade trie.
	if err := h.dp.objs.NomasqV4.Delete(lpmKey(netip.MustParsePrefix("10.0.0.0/8"))); err != nil {
		t.Fatal(err)
	}
	if out := tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(ap(pod4(2), 1000), dst, nil))); out.src.Addr() != snat4 {
		t.Fatalf("the drift did not take 10/8 out: %v", out)
	}
	// Without Refresh, the sync trusts its mirror and writes nothing.
	if err := h.dp.SyncPolicy(p); err != nil {
		t.Fatal(err)
	}
	if out := tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(ap(pod4(3), 1000), dst, nil))); out.src.Addr() != snat4 {
		t.Fatalf("a sync without Refresh changed the trie: %v", out)
	}
	before := h.statsByPrefix()
	if err := h.dp.Refresh(); err != nil {
		t.Fatal(err)
	}
	if err := h.dp.SyncPolicy(p); err != nil {
		t.Fatal(err)
	}
	if out := tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(ap(pod4(4), 1000), dst, nil))); out.src.Addr() != pod4(4) {
		t.Fatalf("10/8 still masqueraded after Refresh and a sync: %v", out)
	}
	after := h.statsByPrefix()
	for k, s := range before {
		if after[k].Slot != s.Slot {
			t.Errorf("%s moved from slot %d to %d", k, s.Slot, after[k].Slot)
		}
	}
	if got := after["10.0.0.0/8 RETURN"].Packets; got != before["10.0.0.0/8 RETURN"].Packets+1 {
		t.Errorf("10/8 counted %d packets, want %d", got, before["10.0.0.0/8 RETURN"].Packets+1)
	}
}

// TestSweptEntries: the sweep's removals are totalled by protocol in the maps.
func TestSweptEntries(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	if got, err := h.dp.SweptEntries(); err != nil || len(got) != 0 {
		t.Fatalf("before any sweep: %v %v", got, err)
	}
	for i := range 3 {
		h.mustPass(h.dp.Egress(), udpPacket(ap(pod4(i+1), 1000), ap(remote4, 53), nil))
	}
	h.mustPass(h.dp.Egress(), tcpPacket(ap(pod6(1), 1000), ap(remote6, 443), tcpSYN, nil))
	h.mustPass(h.dp.Egress(), echoPacket(pod4(9), remote4, 77, true, nil))
	timeouts := Timeouts{TCPEstablished: time.Hour, TCPOpening: time.Minute, TCPClosing: time.Minute,
		UDP: time.Minute, ICMP: time.Minute, Other: time.Minute}
	for range 2 { // the second sweep adds to the totals
		if _, err := h.dp.Sweep(MonotonicNow()+2*time.Minute, timeouts); err != nil {
			t.Fatal(err)
		}
	}
	got, err := h.dp.SweptEntries()
	if err != nil {
		t.Fatal(err)
	}
	// Each flow is two entries.
	want := map[uint8]uint64{unix.IPPROTO_UDP: 6, unix.IPPROTO_TCP: 2, unix.IPPROTO_ICMP: 2}
	if len(got) != len(want) {
		t.Fatalf("swept %v, want %v", got, want)
	}
	for p, n := range want {
		if got[p] != n {
			t.Errorf("protocol %d: swept %d, want %d", p, got[p], n)
		}
	}
	// More flows, swept later, add to the totals.
	h.mustPass(h.dp.Egress(), udpPacket(ap(pod4(20), 1000), ap(remote4, 53), nil))
	if _, err := h.dp.Sweep(MonotonicNow()+2*time.Minute, timeouts); err != nil {
		t.Fatal(err)
	}
	if got, err := h.dp.SweptEntries(); err != nil || got[unix.IPPROTO_UDP] != 8 {
		t.Fatalf("after another UDP flow: %v %v, want 8 UDP entries", got, err)
	}
}

// TestResizedMapsKeepFlows: maps whose size changed are set aside (SetAside) where Inspect finds
// them as a source of this layout, and migrated into the maps Load makes at the new size: every
// flow keeps its mapping both ways. Confirmed tables made smaller than their flows leave the
// flows without room in the unreplied tables (FlagNoRoom), where they still translate.
func TestResizedMapsKeepFlows(t *testing.T) {
	root := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
	dir := LayoutDir(root)
	opts := LoadOptions{PinPath: dir, NATEntries: 1 << 12, NATEntriesV6: 1 << 6}
	dp, err := Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := dp.SyncPolicy(defaultPolicy(true)); err != nil {
		t.Fatal(err)
	}
	if _, err := dp.SetUplink(testIfindex, Uplink{IPv4: snat4, IPv6: snat6}); err != nil {
		t.Fatal(err)
	}
	// 30 two-way (confirmed) UDP flows per family: 60 entries each.
	type flow struct{ pod, dst, nat netip.AddrPort }
	var flows []flow
	h := &harness{t: t, dp: dp}
	for i := range 30 {
		for _, f := range []flow{{pod: ap(pod4(i+1), 4000), dst: ap(remote4, 53)}, {pod: ap(pod6(i+1), 4000), dst: ap(remote6, 53)}} {
			f.nat = tupleOf(t, h.mustPass(dp.Egress(), udpPacket(f.pod, f.dst, nil))).src
			h.mustPass(dp.Ingress(), udpPacket(f.dst, f.nat, nil))
			h.mustPass(dp.Egress(), udpPacket(f.pod, f.dst, nil))
			flows = append(flows, f)
		}
	}
	dp.Close()

	resize := func(o LoadOptions, want []string) (*Datapath, *Migration) {
		t.Helper()
		mm, err := CheckPins(o)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, m := range mm {
			if !carriedOnResize(m.Map) {
				t.Fatalf("%s (%s) would not be carried", m.Map, m.Reason)
			}
			names = append(names, m.Map)
		}
		if !slices.Equal(names, want) {
			t.Fatalf("resized maps %v, want %v", names, want)
		}
		aside, err := SetAside(dir, names...)
		if err != nil {
			t.Fatal(err)
		}
		pins, err := Inspect(root)
		if err != nil {
			t.Fatal(err)
		}
		if !pins.Current || len(pins.Sources) != 1 || pins.Sources[0].Dir != aside || !pins.Sources[0].Resized() || pins.Sources[0].Layout != Layout {
			t.Fatalf("Inspect found %+v, want this layout's directory and the resized maps in %s", pins, aside)
		}
		dp, err := Load(o)
		if err != nil {
			t.Fatal(err)
		}
		mig, err := dp.Migrate(pins.Sources)
		if err != nil {
			t.Fatal(err)
		}
		if err := mig.Finish(dp); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(aside); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("the resized maps' directory is left after the migration: %v", err)
		}
		if mm, err := CheckPins(o); err != nil || len(mm) != 0 {
			t.Fatalf("after the migration: mismatches %v %v", mm, err)
		}
		return dp, mig
	}
	check := func(dp *Datapath, when string) {
		t.Helper()
		h := &harness{t: t, dp: dp}
		for _, f := range flows {
			if got := tupleOf(t, h.mustPass(dp.Egress(), udpPacket(f.pod, f.dst, nil))).src; got != f.nat {
				t.Fatalf("%s: %s leaves as %s, want %s", when, f.pod, got, f.nat)
			}
			if got := tupleOf(t, h.mustPass(dp.Ingress(), udpPacket(f.dst, f.nat, nil))).dst; got != f.pod {
				t.Fatalf("%s: the reply to %s arrives at %s, want %s", when, f.nat, got, f.pod)
			}
		}
	}

	// The IPv6 tables grow; the IPv4 ones keep their maps and flows.
	grown := opts
	grown.NATEntriesV6 = 1 << 12
	dp, mig := resize(grown, []string{"nat_new_v6", "nat_v6"})
	// Entries counts what each pass carried: the flows touched since the first are carried again.
	if mig.Entries["nat_v6"] < 60 || mig.NoRoom != 0 {
		t.Errorf("carried %v (%d without room), want the 60 IPv6 entries", mig.Entries, mig.NoRoom)
	}
	if n := rawEntries(t, dp.objs.NatV6); n != 60 {
		t.Errorf("the grown nat_v6 holds %d entries, want the 60 of the old one", n)
	}
	check(dp, "grown")
	dp.Close()

	// Both families' tables shrink below their 60 entries: 48 stay confirmed, 12 lose their room.
	shrunk := LoadOptions{PinPath: dir, NATEntries: 48, NATEntriesV6: 48}
	dp, mig = resize(shrunk, []string{"nat_new_v4", "nat_new_v6", "nat_v4", "nat_v6"})
	defer dp.Close()
	if mig.NoRoom != 2*12 {
		t.Errorf("%d entries without room, want 24", mig.NoRoom)
	}
	for _, fam := range policy.Families() {
		confirmed, noRoom := 0, 0
		if err := dp.NATEntries(fam, func(e NATEntry) bool {
			switch {
			case e.Table == TableConfirmed:
				confirmed++
			case e.Flags&FlagNoRoom != 0 && e.Flags&FlagReplied != 0:
				noRoom++
			}
			return true
		}); err != nil {
			t.Fatal(err)
		}
		if confirmed != 48 || noRoom != 12 {
			t.Errorf("%s: %d confirmed entries and %d replied ones without room, want 48 and 12", fam, confirmed, noRoom)
		}
	}
	check(dp, "shrunk")
}

// TestScratchNotPinned: the programs' per-CPU scratch (scratchMaps) holds nothing from one run to
// the next: no load pins it, and a load over the pins of an earlier build of this layout, which
// pinned its scratch as nat_scratch, passes over that pin (Inspect) and removes it, keeping every
// other map and the flows in them.
func TestScratchNotPinned(t *testing.T) {
	root := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
	opts := LoadOptions{PinPath: LayoutDir(root), NATEntries: 1 << 12}
	first, err := Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	h := &harness{t: t, dp: first}
	if err := first.SyncPolicy(defaultPolicy(true)); err != nil {
		t.Fatal(err)
	}
	if _, err := first.SetUplink(testIfindex, Uplink{IPv4: snat4, IPv6: snat6}); err != nil {
		t.Fatal(err)
	}
	podEnd, dst := ap(pod4(1), 40000), ap(remote4, 443)
	nat := h.established(podEnd, dst)
	if got, want := pinNames(t, opts.PinPath), MapNames(); !slices.Equal(got, want) {
		t.Fatalf("pins %v, want %v", got, want)
	}
	for name := range scratchMaps {
		if slices.Contains(MapNames(), name) {
			t.Errorf("MapNames lists the scratch map %s", name)
		}
	}

	// What an earlier build of this layout left: its scratch, pinned.
	pinMap(t, filepath.Join(opts.PinPath, "nat_scratch"), &ebpf.MapSpec{Type: ebpf.PerCPUArray, KeySize: 4, ValueSize: 312, MaxEntries: 1})
	if pins, err := Inspect(root); err != nil || !pins.Current || len(pins.Sources) != 0 {
		t.Fatalf("Inspect: %+v, %v", pins, err)
	}
	second, err := Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	if got, want := pinNames(t, opts.PinPath), MapNames(); !slices.Equal(got, want) {
		t.Fatalf("pins after the second load %v, want %v", got, want)
	}
	h2 := &harness{t: t, dp: second, ns: h.ns}
	if got := tupleOf(t, h2.mustPass(second.Egress(), tcpPacket(podEnd, dst, tcpACK, nil))).src; got != nat {
		t.Fatalf("the flow leaves from %s after the second load, want %s", got, nat)
	}
	if got := tupleOf(t, h2.mustPass(second.Ingress(), tcpPacket(dst, nat, tcpACK, nil))).dst; got != podEnd {
		t.Fatalf("its reply arrives at %s, want %s", got, podEnd)
	}
}
