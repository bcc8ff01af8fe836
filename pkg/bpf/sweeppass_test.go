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
// urgent, and it judges closing flows by the shorter idle time of a table under pressure. The
// IPv6 table, of 1024 entries, is not taken to fill with IPv4's flows.
func TestMayBePressed(t *testing.T) {
	const entries = DefaultNATEntries
	h := newHarness(t, defaultPolicy(true), LoadOptions{NATEntries: entries, NATEntriesV6: 1024})
	pressed := func() bool {
		t.Helper()
		p, err := h.dp.MayBePressed()
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	dst := ap(remote4, 443)
	confirm := func(pod, n int) { // n two-way flows, confirmed by the programs
		for i := range n {
			podEnd := ap(pod4(pod), uint16(2000+i))
			nat := tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(podEnd, dst, payload))).src
			h.mustPass(h.dp.Ingress(), udpPacket(dst, nat, payload))
			h.mustPass(h.dp.Egress(), udpPacket(podEnd, dst, payload))
		}
	}
	if _, err := h.dp.Sweep(MonotonicNow(), DefaultTimeouts); err != nil {
		t.Fatal(err)
	}
	confirm(8, 500) // 1000 IPv4 entries: the 1024 of IPv6 seem full, if IPv4's flows counted there
	if pressed() {
		t.Fatal("500 IPv4 flows since the last count: MayBePressed says a table is under pressure")
	}
	now := MonotonicNow()
	fill := pressureFill
	mark := int(fill*entries) + 1            // entries: 235930
	fillFlows(t, h.dp, 0, mark/2-2-500, now) // 4 entries short of the mark, written by hand: counted by no counter
	res, err := h.dp.Sweep(MonotonicNow(), DefaultTimeouts)
	if err != nil || res.Urgent {
		t.Fatalf("sweep of a table short of the mark: %+v %v, want it not urgent", res.Swept, err)
	}
	if pressed() {
		t.Fatal("a table counted short of 90% full may be under pressure, says MayBePressed")
	}
	confirm(9, 2) // 4 entries more: the mark
	if !pressed() {
		t.Fatal("2 flows confirmed since a count 4 entries short of the mark: MayBePressed says no pressure")
	}
	if res, err = h.dp.Sweep(MonotonicNow(), DefaultTimeouts); err != nil || !res.Urgent {
		t.Fatalf("sweep of a table 90%% full: %+v %v, want it urgent", res.Swept, err)
	}
	// Under pressure, closing flows go once idle for pressureIdle.
	closing := MonotonicNow() - 2*pressureIdle
	putFlow(t, h.dp.objs.NatV4, 100, unix.IPPROTO_TCP, half{FlagReplied | FlagFIN, closing}, half{FlagReplied | FlagFIN, closing})
	if res, err = h.dp.Sweep(MonotonicNow(), DefaultTimeouts); err != nil || res.Flows != 1 {
		t.Fatalf("sweep under pressure: %+v %v, want the closing flow idle for %v removed", res.Swept, err, 2*pressureIdle)
	}
}
