package bpf

import (
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// half is one half of a flow as putFlow writes it: its flags and when it was last seen; a zero
// half is not written (an orphan's missing partner).
type half struct {
	flags Flags
	seen  time.Duration
}

// putFlow writes the i-th masqueraded IPv4 flow of proto (pod4(1):i to remote4:80, mapped to
// snat4:i) into m, its egress and ingress halves as given.
func putFlow(t *testing.T, m *ebpf.Map, i int, proto uint8, egress, ingress half) {
	t.Helper()
	pod, port := pod4(1), uint16(1024+i)
	if egress != (half{}) {
		k := natKey(Egress, proto, netip.AddrPortFrom(pod, port), netip.AddrPortFrom(remote4, 80))
		v := masqNatEntry{Addr: addrBytes(snat4), Port: htons(port), Kind: masqNatKind(KindMasq),
			Flags: masqNatFlags(egress.flags | FlagOrig), LastSeen: uint64(egress.seen)}
		if err := m.Put(k, &v); err != nil {
			t.Fatal(err)
		}
	}
	if ingress != (half{}) {
		k := natKey(Ingress, proto, netip.AddrPortFrom(remote4, 80), netip.AddrPortFrom(snat4, port))
		v := masqNatEntry{Addr: addrBytes(pod), Port: htons(port), Kind: masqNatKind(KindMasq),
			Flags: masqNatFlags(ingress.flags), Slot: noSlot, LastSeen: uint64(ingress.seen)}
		if err := m.Put(k, &v); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSweepCensus: what a sweep counts it left is what a walk of the tables finds after it, and
// its Due is the earliest time an entry it left (or a new one) can expire.
func TestSweepCensus(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{NATEntries: 1 << 12})
	now := MonotonicNow() + time.Hour // room for the past
	tt := DefaultTimeouts
	est := FlagReplied
	confirmed, unreplied := h.dp.objs.NatV4, h.dp.objs.NatNewV4
	ago := func(d time.Duration) time.Duration { return now - d }
	i := 0
	put := func(m *ebpf.Map, proto uint8, e, in half) {
		putFlow(t, m, i, proto, e, in)
		i++
	}
	put(confirmed, unix.IPPROTO_UDP, half{est, ago(time.Second)}, half{est, ago(time.Second)})                             // live
	put(confirmed, unix.IPPROTO_UDP, half{est, ago(3 * time.Minute)}, half{est, ago(3 * time.Minute)})                     // expired
	put(confirmed, unix.IPPROTO_TCP, half{est, ago(time.Hour)}, half{est, ago(time.Hour)})                                 // idle, established
	put(confirmed, unix.IPPROTO_TCP, half{est | FlagFIN, ago(3 * time.Minute)}, half{est | FlagFIN, ago(time.Minute)})     // closing, seen a minute ago
	put(confirmed, unix.IPPROTO_TCP, half{est | FlagFIN, ago(3 * time.Minute)}, half{est | FlagFIN, ago(3 * time.Minute)}) // closed, expired
	put(confirmed, unix.IPPROTO_ICMP, half{}, half{est, ago(10 * time.Second)})                                            // orphan, live
	put(confirmed, unix.IPPROTO_ICMP, half{}, half{est, ago(time.Minute)})                                                 // orphan, expired
	put(unreplied, unix.IPPROTO_TCP, half{0, ago(30 * time.Second)}, half{0, ago(30 * time.Second)})                       // opening
	put(unreplied, unix.IPPROTO_UDP, half{0, ago(5 * time.Minute)}, half{0, ago(5 * time.Minute)})                         // unanswered, expired
	put(unreplied, unix.IPPROTO_UDP, half{est, ago(2 * time.Second)}, half{0, ago(2 * time.Second)})                       // confirming
	keep := func(j int, closing uint8, seen time.Duration) {
		k := natKey(Egress, unix.IPPROTO_TCP, netip.AddrPortFrom(pod4(2), uint16(2000+j)), netip.AddrPortFrom(remote4, 443))
		if err := h.dp.objs.KeepV4.Put(k, &masqKeepEntry{Slot: noSlot, Closing: closing, LastSeen: uint64(seen)}); err != nil {
			t.Fatal(err)
		}
	}
	keep(0, 0, ago(time.Minute))
	keep(1, 1, ago(3*time.Minute)) // closing, expired

	res, err := h.dp.Sweep(now, tt)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Swept{Flows: 3, Orphans: 1, Kept: 1}); res.Swept != want {
		t.Errorf("the sweep removed %+v, want %+v", res.Swept, want)
	}
	if res.Read != 2*10-2+2 {
		t.Errorf("the sweep read %d entries, want %d", res.Read, 2*10-2+2)
	}
	walked, err := h.dp.CountNAT(policy.IPv4)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(res.Counts[policy.IPv4], walked) {
		t.Errorf("the sweep counted\n%+v\nleft, a walk after it finds\n%+v", res.Counts[policy.IPv4], walked)
	}
	// The live ICMP orphan is the first to expire, in 20 s.
	if want := ago(10*time.Second) + tt.ICMP; res.Due != want {
		t.Errorf("due at now%+v, want now%+v (the ICMP orphan's)", res.Due-now, want-now)
	}
	// With none left that expires sooner, new entries bound it: the shortest timeout from now.
	res, err = h.dp.Sweep(now+tt.TCPClosing, tt)
	if err != nil {
		t.Fatal(err)
	}
	if want := now + tt.TCPClosing + tt.ICMP; res.Due != want {
		t.Errorf("due at now%+v, want now%+v (ICMP's timeout after the sweep)", res.Due-now, want-now)
	}
}

// TestSweepJudgesFromEitherHalf: a flow whose closing flags only one half carries (the datapath
// writes both, one after the other) expires by them, whichever half it is.
func TestSweepJudgesFromEitherHalf(t *testing.T) {
	for _, finOn := range []Direction{Egress, Ingress} {
		t.Run(finOn.String(), func(t *testing.T) {
			h := newHarness(t, defaultPolicy(true), LoadOptions{NATEntries: 1 << 10})
			now := MonotonicNow() + time.Hour
			idle := now - DefaultTimeouts.TCPClosing - time.Minute // past closing, far from established
			e, in := half{FlagReplied, idle}, half{FlagReplied, idle}
			if finOn == Egress {
				e.flags |= FlagFIN
			} else {
				in.flags |= FlagFIN
			}
			putFlow(t, h.dp.objs.NatV4, 0, unix.IPPROTO_TCP, e, in)
			putFlow(t, h.dp.objs.NatV4, 1, unix.IPPROTO_TCP, half{FlagReplied, idle}, half{FlagReplied, idle}) // established
			res, err := h.dp.Sweep(now, DefaultTimeouts)
			if err != nil {
				t.Fatal(err)
			}
			if res.Swept != (Swept{Flows: 1}) {
				t.Errorf("the sweep removed %+v, want the closed flow", res.Swept)
			}
			if n := natCount(t, h.dp); n != 2 {
				t.Errorf("%d entries left, want the established flow's 2", n)
			}
		})
	}
}

// TestSweepUrgentUnderPressure: a sweep after one that found the confirmed table 90% full asks
// for the next within an interval, whatever its Due; one of a roomy table does not.
func TestSweepUrgentUnderPressure(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{NATEntries: 1 << 12})
	now := MonotonicNow() + time.Hour
	capacity := int(h.dp.Capacity(policy.IPv4, TableConfirmed))
	fillFlows(t, h.dp, 0, capacity/4, now)
	for i := range 2 {
		if res, err := h.dp.Sweep(now, DefaultTimeouts); err != nil || res.Urgent {
			t.Fatalf("sweep %d of a half-full table: urgent %v (%v)", i, res.Urgent, err)
		}
	}
	fillFlows(t, h.dp, capacity/4, capacity/4, now)
	if _, err := h.dp.Sweep(now, DefaultTimeouts); err != nil {
		t.Fatal(err)
	}
	if res, err := h.dp.Sweep(now, DefaultTimeouts); err != nil || !res.Urgent {
		t.Fatalf("a sweep of a full table: urgent %v (%v), want urgent", res.Urgent, err)
	}
}
