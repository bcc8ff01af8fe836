package bpf

import (
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// TestSweepPaced: a pass taken a batch per step, while entries are added and removed between
// steps, reads each entry that stays once: the census counts every flow that was there all
// along exactly once (none twice, none missed), at most the ones added or removed meanwhile,
// and every expired flow there all along goes.
func TestSweepPaced(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{NATEntries: 1 << 16})
	now := MonotonicNow() + 2*time.Hour // room for the past
	const stay, leave, expired, added = 8000, 2000, 4000, 3000
	m := h.dp.objs.NatV4
	same := func(e masqNatEntry) masqNatEntry { return e }
	fillFlowsOf(t, m, unix.IPPROTO_UDP, 0, stay+leave, now, same)
	fillFlowsOf(t, m, unix.IPPROTO_UDP, stay+leave, expired, now-time.Hour, same)
	// The leavers' keys: flow i's egress half has source port 1024+i, its ingress half
	// destination port 32768+i (fillFlowsOf).
	var leavers []masqNat4Key
	if err := walkNAT(m, func(keys []masqNat4Key, _ []masqNatEntry, n int) bool {
		for _, k := range keys[:n] {
			i := int(htons(k.Sport)) - 1024
			if k.Dir == masqNatDir(Ingress) {
				i = int(htons(k.Dport)) - 32768
			}
			if i >= stay && i < stay+leave {
				leavers = append(leavers, k)
			}
		}
		return true
	}); err != nil {
		t.Fatal(err)
	}
	if len(leavers) != 2*leave {
		t.Fatalf("%d keys of the %d leaving flows", len(leavers), leave)
	}

	p := h.dp.NewSweep(now, DefaultTimeouts)
	steps := 0
	for {
		over, err := p.Step(now, func() bool { return false })
		if err != nil {
			t.Fatal(err)
		}
		if steps++; over {
			break
		}
		if steps == 2 { // the walk has read a batch or two of the confirmed table
			fillFlowsOf(t, m, unix.IPPROTO_TCP, 0, added, now, same)
			if _, err := m.BatchDelete(leavers, nil); err != nil {
				t.Fatal(err)
			}
		}
	}
	res := p.Result()
	if steps < 8 {
		t.Errorf("the pass took %d steps, want one per batch (7 of the confirmed table, at least)", steps)
	}
	byProto := map[uint8]uint64{}
	for _, c := range res.Counts[policy.IPv4] {
		if c.Table == TableConfirmed {
			byProto[c.Proto] += c.N
		}
	}
	if n := byProto[unix.IPPROTO_UDP]; n < 2*stay || n > 2*(stay+leave) {
		t.Errorf("the census counts %d UDP entries, want the %d that stayed and at most the %d that left", n, 2*stay, 2*leave)
	}
	if n := byProto[unix.IPPROTO_TCP]; n > 2*added {
		t.Errorf("the census counts %d TCP entries, more than the %d added", n, 2*added)
	}
	if res.Flows != expired || res.Orphans != 0 {
		t.Errorf("the pass removed %d flows and %d orphans, want the %d expired flows", res.Flows, res.Orphans, expired)
	}
	if swept, err := h.dp.SweptEntries(); err != nil || swept[unix.IPPROTO_UDP] != 2*expired {
		t.Errorf("swept entries %v (%v), want %d UDP", swept, err, 2*expired)
	}
	// Whole, the next pass finds what the table holds: none expired, the rest counted once.
	whole, err := h.dp.Sweep(now, DefaultTimeouts)
	if err != nil {
		t.Fatal(err)
	}
	if whole.Flows != 0 || whole.Read != 2*(stay+added) {
		t.Errorf("a whole pass after it removed %d flows and read %d entries, want none and %d", whole.Flows, whole.Read, 2*(stay+added))
	}
}

// TestMayBePressed: a table that fills after its last count is noticed without a walk, from
// the datapath's count of confirmed flows; the sweep that counts it then says the next pass is
// urgent, and it judges closing flows by the shorter idle time of a table under pressure.
func TestMayBePressed(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{NATEntries: 64})
	pressed := func() bool {
		t.Helper()
		p, err := h.dp.MayBePressed()
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	now := MonotonicNow()
	fillFlows(t, h.dp, 0, 25, now) // 50 of 64 entries, written by hand: counted by no counter
	if pressed() {
		t.Fatal("a table never counted says it may be under pressure")
	}
	res, err := h.dp.Sweep(MonotonicNow(), DefaultTimeouts)
	if err != nil || res.Urgent {
		t.Fatalf("sweep of a table 50/64 full: %+v %v, want it not urgent", res, err)
	}
	if pressed() {
		t.Fatal("a table counted 50/64 full may be under pressure, says MayBePressed; the mark is 90%")
	}
	dst := ap(remote4, 443)
	for i := range 4 { // two-way flows: 58 entries, beyond the mark (57.6)
		podEnd := ap(pod4(9), uint16(2000+i))
		nat := tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(podEnd, dst, payload))).src
		h.mustPass(h.dp.Ingress(), udpPacket(dst, nat, payload))
		h.mustPass(h.dp.Egress(), udpPacket(podEnd, dst, payload)) // confirms it
	}
	if !pressed() {
		t.Fatal("4 flows confirmed since a count of 50 entries of 64: MayBePressed says no pressure")
	}
	if res, err = h.dp.Sweep(MonotonicNow(), DefaultTimeouts); err != nil || !res.Urgent {
		t.Fatalf("sweep of a table 58/64 full: %+v %v, want it urgent", res, err)
	}
	// Under pressure, closing flows go once idle for pressureIdle.
	closing := MonotonicNow() - 2*pressureIdle
	putFlow(t, h.dp.objs.NatV4, 100, unix.IPPROTO_TCP, half{FlagReplied | FlagFIN, closing}, half{FlagReplied | FlagFIN, closing})
	if res, err = h.dp.Sweep(MonotonicNow(), DefaultTimeouts); err != nil || res.Flows != 1 {
		t.Fatalf("sweep under pressure: %+v %v, want the closing flow idle for %v removed", res, err, 2*pressureIdle)
	}
}
