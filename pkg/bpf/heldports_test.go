package bpf

import (
	"bytes"
	"net/netip"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

func rangesPolicy(r policy.PortRanges) *policy.Policy {
	return policy.Compile(config.Default(config.Options{EnableIPv6: true}),
		policy.Options{EnableIPv6: true, RandomFully: true, ToPorts: r})
}

// TestPortRangeChangeKeepsFlows: after --to-ports changes (an agent restarted with another
// range, over the pinned maps), the TCP, UDP and ICMP flows mapped to ports of the old range
// keep working both ways, as conntrack keeps every binding; new flows get ports of the new
// range; a host flow on a port an old flow holds toward the same remote moves off it, one
// toward another remote keeps its port. The ports stay held while flows hold them, and once
// those are swept replies to them are not even looked up.
func TestPortRangeChangeKeepsFlows(t *testing.T) {
	testutil.RequirePrivileged(t, "ip")
	oldRange := policy.PortRanges{{First: 40000, Last: 40009}}
	newRange := policy.PortRanges{{First: 50000, Last: 50009}}
	dir := testutil.MountBPFFS(t)
	load := func(r policy.PortRanges) *harness {
		t.Helper()
		dp, err := Load(LoadOptions{PinPath: dir, NATEntries: 1 << 12})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { dp.Close() })
		if err := dp.SyncPolicy(rangesPolicy(r)); err != nil {
			t.Fatal(err)
		}
		if _, err := dp.SetUplink(testIfindex, Uplink{IPv4: snat4, IPv6: snat6}); err != nil {
			t.Fatal(err)
		}
		return &harness{t: t, dp: dp}
	}
	type flows struct {
		tcpPod, udpPod, dst, udpDst  netip.AddrPort
		tcpNAT, udpNAT               netip.AddrPort
		echoID, echoNAT              uint16
		podAddr, remoteAddr, snatFor netip.Addr
	}
	h := load(oldRange)
	var open []flows
	for i, fam := range families {
		f := flows{podAddr: pod(fam.v6, 1), remoteAddr: remote(fam.v6), snatFor: snatFor(remote(fam.v6))}
		f.tcpPod, f.udpPod = ap(f.podAddr, 1000), ap(f.podAddr, 1001)
		f.dst, f.udpDst = ap(f.remoteAddr, 443), ap(f.remoteAddr, 53)
		f.tcpNAT = h.handshake(f.tcpPod, f.dst)
		f.udpNAT = tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(f.udpPod, f.udpDst, nil))).src
		f.echoID = uint16(7 + i)
		f.echoNAT = tupleOf(t, h.mustPass(h.dp.Egress(), echoPacket(f.podAddr, f.remoteAddr, f.echoID, true, nil))).src.Port()
		for _, p := range []uint16{f.tcpNAT.Port(), f.udpNAT.Port(), f.echoNAT} {
			if !inRanges(oldRange, p) {
				t.Fatalf("%s: a flow of the old range got port %d", fam.name, p)
			}
		}
		open = append(open, f)
	}
	h.dp.Close()

	h = load(newRange)
	if got := h.dp.HeldPorts(); !slices.Equal(got, oldRange) {
		t.Fatalf("held ports %v after the change, want the old range %v", got, oldRange)
	}
	for i, fam := range families {
		f := open[i]
		// Both ways, each flow as before.
		if got := tupleOf(t, h.mustPass(h.dp.Ingress(), tcpSegment(f.dst, f.tcpNAT, seg{flags: tcpACK, seq: 5001, ack: 1001, win: 502, wscale: -1}))).dst; got != f.tcpPod {
			t.Errorf("%s: a TCP reply to %s went to %s, want the pod's %s", fam.name, f.tcpNAT, got, f.tcpPod)
		}
		if got := tupleOf(t, h.mustPass(h.dp.Egress(), tcpSegment(f.tcpPod, f.dst, seg{flags: tcpACK, seq: 1001, ack: 5001, win: 502, wscale: -1}))).src; got != f.tcpNAT {
			t.Errorf("%s: the TCP flow left from %s, want %s as before", fam.name, got, f.tcpNAT)
		}
		if got := tupleOf(t, h.mustPass(h.dp.Ingress(), udpPacket(f.udpDst, f.udpNAT, nil))).dst; got != f.udpPod {
			t.Errorf("%s: a UDP reply to %s went to %s, want %s", fam.name, f.udpNAT, got, f.udpPod)
		}
		if got := tupleOf(t, h.mustPass(h.dp.Ingress(), echoPacket(f.remoteAddr, f.snatFor, f.echoNAT, false, nil))).dst.Port(); got != f.echoID {
			t.Errorf("%s: an echo reply to id %d reached id %d, want %d", fam.name, f.echoNAT, got, f.echoID)
		}
		// New flows: the new range.
		if got := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(ap(f.podAddr, 2000), f.dst, tcpSYN, nil))).src.Port(); !inRanges(newRange, got) {
			t.Errorf("%s: a new flow got port %d, want one of %v", fam.name, got, newRange)
		}
		// A host socket on the port the pod's TCP flow holds: toward the same remote it moves
		// to a port of the range (and its reply comes back to it); toward another it is
		// recorded on its own port.
		hostEnd := ap(f.snatFor, f.tcpNAT.Port())
		moved := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(hostEnd, f.dst, tcpSYN, nil))).src
		if moved.Port() == hostEnd.Port() || !inRanges(newRange, moved.Port()) {
			t.Errorf("%s: a host flow on a held port toward the pod flow's remote left from %s, want a port of %v", fam.name, moved, newRange)
		}
		if got := tupleOf(t, h.mustPass(h.dp.Ingress(), tcpPacket(f.dst, moved, tcpSYN|tcpACK, nil))).dst; got != hostEnd {
			t.Errorf("%s: the moved host flow's reply went to %s, want %s", fam.name, got, hostEnd)
		}
		other := ap(f.remoteAddr, 444)
		if got := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(hostEnd, other, tcpSYN, nil))).src; got != hostEnd {
			t.Errorf("%s: a host flow on a held port toward another remote left from %s, want its own %s", fam.name, got, hostEnd)
		}
		if e, ok := h.entry(Egress, unix.IPPROTO_TCP, hostEnd, other); !ok || e.Kind != KindHost {
			t.Errorf("%s: the host flow on a held port is not recorded: %+v", fam.name, e)
		}
	}

	// Held: exactly the ports flows hold (not the host flow's own), until they are swept.
	var want portBits
	for _, f := range open {
		for _, p := range []uint16{f.tcpNAT.Port(), f.udpNAT.Port(), f.echoNAT} {
			want.add(p)
		}
	}
	if n, err := h.dp.TrimHeldPorts(); err != nil || n != want.count() || !slices.Equal(h.dp.HeldPorts(), want.ranges()) {
		t.Fatalf("trimmed: %d held (%v), %v; want %v", n, h.dp.HeldPorts(), err, want.ranges())
	}
	if _, err := h.dp.Sweep(MonotonicNow()+30*24*time.Hour, DefaultTimeouts); err != nil {
		t.Fatal(err)
	}
	if n, err := h.dp.TrimHeldPorts(); err != nil || n != 0 {
		t.Fatalf("after the sweep: %d ports held (%v), want none", n, err)
	}
	// Released: an entry planted at a formerly held port is not consulted.
	f := open[0]
	planted := keyTuple(Ingress, unix.IPPROTO_TCP, f.dst, f.tcpNAT)
	v := masqNatEntry{Addr: addrBytes(f.podAddr), Port: htons(f.tcpPod.Port()), Kind: masqNatKind(KindMasq),
		Flags: masqNatFlags(FlagReplied), LastSeen: uint64(MonotonicNow())}
	if err := h.dp.natTable(policy.IPv4).tables()[TableConfirmed].Put(planted.key(), &v); err != nil {
		t.Fatal(err)
	}
	in := tcpPacket(f.dst, f.tcpNAT, tcpACK, nil)
	if out := h.mustPass(h.dp.Ingress(), in); !bytes.Equal(out, in) {
		t.Fatalf("a packet to a released port was translated to %s", tupleOf(t, out).dst)
	}
}

// TestHeldPortsOfUnknownRanges: maps that hold flows but no ranges (a migration from an older
// layout's maps, whose ranges a sync does not know) hold every port until a trim has seen
// which ones flows hold; empty ones hold none.
func TestHeldPortsOfUnknownRanges(t *testing.T) {
	testutil.RequirePrivileged(t, "ip")
	r := policy.PortRanges{{First: 50000, Last: 50009}}
	for _, flows := range []bool{false, true} {
		dp, err := Load(LoadOptions{NATEntries: 1 << 12})
		if err != nil {
			t.Fatal(err)
		}
		defer dp.Close()
		e := NATEntry{Dir: Ingress, Proto: unix.IPPROTO_UDP, Src: ap(remote4, 53), Dst: ap(snat4, 33333),
			To: ap(pod4(1), 1000), Kind: KindMasq, Flags: FlagReplied}
		if flows {
			kt := keyTuple(e.Dir, e.Proto, e.Src, e.Dst)
			v := masqNatEntry{Addr: addrBytes(e.To.Addr()), Port: htons(e.To.Port()), Kind: masqNatKind(e.Kind),
				Flags: masqNatFlags(e.Flags), LastSeen: uint64(MonotonicNow())}
			if err := dp.natTable(policy.IPv4).tables()[TableConfirmed].Put(kt.key(), &v); err != nil {
				t.Fatal(err)
			}
		}
		if err := dp.SyncPolicy(rangesPolicy(r)); err != nil {
			t.Fatal(err)
		}
		want := policy.PortRanges(nil)
		if flows {
			want = policy.PortRanges{{First: 1, Last: 49999}, {First: 50010, Last: 65535}}
		}
		if got := dp.HeldPorts(); !slices.Equal(got, want) {
			t.Errorf("flows %v: held %v, want %v", flows, got, want)
		}
		if flows {
			want = policy.PortRanges{{First: 33333, Last: 33333}}
		}
		if _, err := dp.TrimHeldPorts(); err != nil || !slices.Equal(dp.HeldPorts(), want) {
			t.Errorf("flows %v: trimmed to %v (%v), want %v", flows, dp.HeldPorts(), err, want)
		}
	}
}
