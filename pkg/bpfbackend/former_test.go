package bpfbackend

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"github.com/vishvananda/netlink"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
)

// formerNode makes, in the calling thread's namespace, up0 with the default route and up1 with
// a route to 203.0.113.0/24 (up1's MAC is the source of the frames udp builds), and returns up1.
func formerNode(t *testing.T) netlink.Link {
	t.Helper()
	var up1 netlink.Link
	for i, d := range []struct{ addr, dst, gw string }{
		{"192.0.2.1/24", "0.0.0.0/0", "192.0.2.254"},
		{"198.51.100.1/24", "203.0.113.0/24", "198.51.100.254"},
	} {
		attrs := netlink.LinkAttrs{Name: fmt.Sprintf("up%d", i)}
		if i == 1 {
			attrs.HardwareAddr = net.HardwareAddr{2, 0, 0, 0, 0, 1}
		}
		l := &netlink.Veth{LinkAttrs: attrs, PeerName: fmt.Sprintf("peer%d", i)}
		if err := netlink.LinkAdd(l); err != nil {
			t.Fatal(err)
		}
		addr, _ := netlink.ParseAddr(d.addr)
		if err := netlink.AddrAdd(l, addr); err != nil {
			t.Fatal(err)
		}
		if err := netlink.LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
		_, dst, _ := net.ParseCIDR(d.dst)
		if err := netlink.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: dst, Gw: net.ParseIP(d.gw)}); err != nil {
			t.Fatal(err)
		}
		up1 = l
	}
	return up1
}

// TestFormerUplinkDrains: a device that a policy change makes no uplink (its route's
// destinations now kept) while a flow masqueraded out of it is open keeps the programs and its
// SNAT address, and is listed as draining (Uplinks, the dump's Installed, the drift check); once
// the flow is over it is detached. One whose address goes is detached at once with its flows,
// the sweep asking for the apply that does it.
func TestFormerUplinkDrains(t *testing.T) {
	testutil.RequirePrivileged(t)
	bpffs := testutil.MountBPFFS(t)
	inNetns(t, func() {
		ctx := context.Background()
		up1 := formerNode(t)
		idx := up1.Attrs().Index
		snat := netip.MustParseAddr("198.51.100.1")
		b, err := New(ctx, Options{BPFFS: bpffs, SweepInterval: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		// up1's own subnet is kept: else its route would make it an uplink under both.
		masq := compile(t, "nonMasqueradeCIDRs: [10.0.0.0/8, 198.51.100.0/24]\n", false)
		keep := compile(t, "nonMasqueradeCIDRs: [10.0.0.0/8, 198.51.100.0/24, 203.0.113.0/24]\n", false)
		apply := func(p *policy.Policy) {
			t.Helper()
			if err := b.Apply(ctx, p); err != nil {
				t.Fatal(err)
			}
		}
		dp := func() *bpf.Datapath { return b.dp.Load() }
		// via is what Uplinks says of up1 ("" when it lists it not).
		via := func() (string, string) {
			t.Helper()
			ups, err := b.Uplinks(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, u := range ups {
				if u.Ifindex == idx {
					return u.Via, u.Note
				}
			}
			return "", ""
		}
		runs := func() bool {
			t.Helper()
			st, err := b.attach.Check(ctx, idx, tc.Programs{Egress: dp().Egress(), Ingress: dp().Ingress()})
			if err != nil {
				t.Fatal(err)
			}
			return st.Runs
		}
		flows := func() int {
			t.Helper()
			n, err := dp().MasqueradedFlows(snat, nil)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
		// open masquerades a flow out of up1, which must be an uplink.
		open := func() {
			t.Helper()
			apply(masq)
			if v, _ := via(); v != "route 203.0.113.0/24" {
				t.Fatalf("up1 is listed via %q, want its route", v)
			}
			out := runOn(t, dp().Egress(), udp(t, netip.MustParseAddrPort("10.1.0.5:1000"), netip.MustParseAddrPort("203.0.113.7:53")), idx)
			ip := gopacket.NewPacket(out, layers.LayerTypeEthernet, gopacket.Default).Layer(layers.LayerTypeIPv4).(*layers.IPv4)
			if got, _ := netip.AddrFromSlice(ip.SrcIP); got != snat {
				t.Fatalf("the flow leaves up1 from %s, want %s", got, snat)
			}
		}

		open()
		apply(keep)
		v, note := via()
		if v != viaDraining || note != "kept while 1 flow of 198.51.100.1 last" {
			t.Fatalf("up1 with its flow open under a policy that keeps its route: via %q, note %q; want it draining", v, note)
		}
		if !runs() || flows() != 1 {
			t.Fatalf("up1 drains, but runs the programs: %v; its flows: %d", runs(), flows())
		}
		if u, ok, err := dp().Uplink(idx); err != nil || !ok || u.IPv4 != snat {
			t.Fatalf("up1's SNAT address while it drains: %+v %v %v", u, ok, err)
		}
		if drift, err := b.CheckDrift(ctx); err != nil || len(drift) != 0 {
			t.Fatalf("drift while up1 drains: %v %v", drift, err)
		}
		if !strings.Contains(b.Info().Details, "former uplinks draining up1") {
			t.Errorf("details: %s", b.Info().Details)
		}
		// An apply that fails before it has seen up1 leaves it listed.
		b.mu.Lock()
		cur := b.uplinks
		b.mu.Unlock()
		cancelled, cancel := context.WithCancel(ctx)
		cancel()
		if err := b.dropStale(cancelled, dp(), cur, nil); err == nil {
			t.Fatal("dropStale with its context cancelled did not fail")
		}
		if v, _ := via(); v != viaDraining {
			t.Errorf("up1 after an apply that failed: via %q, want it still draining", v)
		}
		r, err := Inspect(bpffs, nil, keep)
		if err != nil {
			t.Fatal(err)
		}
		ups, err := r.Uplinks(ctx)
		r.Close()
		if err != nil || !slices.ContainsFunc(ups, func(u datapath.Uplink) bool { return u.Ifindex == idx && u.Via == viaDraining && u.Covered }) {
			t.Errorf("the reader's uplinks %+v (%v), want up1 draining", ups, err)
		}
		// Detached behind the agent's back, the programs are drift, and come back.
		if err := b.attach.Detach(ctx, idx); err != nil {
			t.Fatal(err)
		}
		if drift, err := b.CheckDrift(ctx); err != nil || !slices.Contains(drift, datapath.DriftProgram) {
			t.Fatalf("drift with up1's programs gone while it drains: %v %v", drift, err)
		}
		apply(keep)
		if !runs() {
			t.Fatal("the apply did not attach the draining uplink again")
		}

		// The flow ends (swept as idle): up1 goes.
		if _, err := dp().Sweep(bpf.MonotonicNow()+time.Hour, bpf.DefaultTimeouts); err != nil {
			t.Fatal(err)
		}
		apply(keep)
		if v, _ := via(); v != "" || runs() {
			t.Fatalf("up1 with no flow left: via %q, runs the programs %v; want it detached", v, runs())
		}
		if _, ok, _ := dp().Uplink(idx); ok {
			t.Fatal("up1 keeps its SNAT address with no flow left")
		}

		// Again, and the address goes: the sweep asks for an apply, which takes the flow.
		open()
		apply(keep)
		if v, _ := via(); v != viaDraining {
			t.Fatalf("up1 via %q, want it draining", v)
		}
		addr, _ := netlink.ParseAddr("198.51.100.1/24")
		if err := netlink.AddrDel(up1, addr); err != nil {
			t.Fatal(err)
		}
		// A reason already waiting would hide checkDraining's (askApply drops it).
		select {
		case <-b.Changes():
		default:
		}
		b.checkDraining(ctx, dp(), false)
		select {
		case reason := <-b.Changes():
			if reason != "former uplink up1: its SNAT address is gone" {
				t.Fatalf("checkDraining asked for an apply for %q", reason)
			}
		default:
			t.Fatal("no apply asked for once up1's address went")
		}
		apply(keep)
		if v, _ := via(); v != "" || runs() || flows() != 0 {
			t.Fatalf("up1 without its address: via %q, runs the programs %v, %d flows of its address left", v, runs(), flows())
		}
	})
}

// TestDrainingCountedPerWalk: the sweep counts a draining former uplink's flows, which reads every
// entry, once per walk of the tables, not at every tick: a paced walk (a large table; every
// table, here) spreads over ticks that must not each read the whole table again.
func TestDrainingCountedPerWalk(t *testing.T) {
	testutil.RequirePrivileged(t)
	bpffs := testutil.MountBPFFS(t)
	inNetns(t, func() {
		ctx := context.Background()
		up1 := formerNode(t)
		var logs testutil.Buffer
		b, err := New(ctx, Options{BPFFS: bpffs, SweepInterval: time.Hour,
			Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		for _, cidrs := range []string{"10.0.0.0/8, 198.51.100.0/24", "10.0.0.0/8, 198.51.100.0/24, 203.0.113.0/24"} {
			if err := b.Apply(ctx, compile(t, "nonMasqueradeCIDRs: ["+cidrs+"]\n", false)); err != nil {
				t.Fatal(err)
			}
			if cidrs == "10.0.0.0/8, 198.51.100.0/24" { // up1 an uplink: a flow out of it
				runOn(t, b.dp.Load().Egress(), udp(t, netip.MustParseAddrPort("10.1.0.5:1000"), netip.MustParseAddrPort("203.0.113.7:53")), up1.Attrs().Index)
			}
		}
		if !strings.Contains(b.Info().Details, "former uplinks draining up1") {
			t.Fatalf("up1 does not drain: %s", b.Info().Details)
		}
		// The backend's own loop walks once, the datapath loaded, then waits for an hour: these
		// ticks are the test's, 10 ms apart as far as the pace is concerned, with flows due at once.
		if err := testutil.Poll(10*time.Second, 10*time.Millisecond, func() error {
			if !strings.Contains(logs.String(), `msg="NAT walk"`) {
				return testutil.NotYet("the backend's first walk")
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		b.largeTables, b.opts.SweepInterval = 1, 10*time.Millisecond
		b.opts.Timeouts = bpf.Timeouts{TCPEstablished: time.Hour, TCPOpening: time.Hour, TCPClosing: time.Hour,
			UDP: time.Hour, ICMP: time.Millisecond, Other: time.Hour}
		from := len(logs.String())
		var s sweepState
		dp := b.dp.Load()
		for range 40 {
			b.sweepTick(ctx, &s, dp)
		}
		ticks := logs.String()[from:]
		walks := strings.Count(ticks, `msg="NAT walk"`)
		counts := strings.Count(ticks, `msg="a former uplink drains"`)
		if walks == 0 || walks >= 20 {
			t.Fatalf("%d walks in 40 ticks, want them paced over several ticks each:\n%s", walks, ticks)
		}
		if counts != walks {
			t.Errorf("the flows of up1 counted %d times in 40 ticks that held %d walks, want once per walk", counts, walks)
		}
	})
}
