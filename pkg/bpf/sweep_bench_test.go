package bpf

import (
	"fmt"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// fillFlows writes flows from, from+1, ... from+n-1 into the IPv4 NAT table as the programs
// would have made them (masqueraded UDP, two entries each), last seen at lastSeen: flow i goes
// from pod4(i>>14) to the 32768 ports of remoteN(i/32768), so every port claim is unique.
func fillFlows(tb testing.TB, d *Datapath, from, n int, lastSeen time.Duration) {
	tb.Helper()
	fillFlowsAs(tb, d.objs.NatV4, from, n, lastSeen, func(e masqNatEntry) masqNatEntry { return e })
}

// fillFlowsAs is fillFlows into any IPv4 NAT table, whose entries enc makes of this layout's.
func fillFlowsAs[V any](tb testing.TB, m *ebpf.Map, from, n int, lastSeen time.Duration, enc func(masqNatEntry) V) {
	tb.Helper()
	fillFlowsOf(tb, m, unix.IPPROTO_UDP, from, n, lastSeen, enc)
}

// fillFlowsOf is fillFlowsAs with flows of another protocol: TCP ones are established.
func fillFlowsOf[V any](tb testing.TB, m *ebpf.Map, proto uint8, from, n int, lastSeen time.Duration, enc func(masqNatEntry) V) {
	tb.Helper()
	const chunk = 8192
	keys := make([]masqNat4Key, 0, 2*chunk)
	vals := make([]V, 0, 2*chunk)
	flush := func() {
		if len(keys) == 0 {
			return
		}
		if _, err := m.BatchUpdate(keys, vals, nil); err != nil {
			tb.Fatalf("fill the NAT table: %v", err)
		}
		keys, vals = keys[:0], vals[:0]
	}
	snat := snat4.As4()
	for i := from; i < from+n; i++ {
		podAddr, remote := pod4(i>>14).As4(), remoteN(i/32768).As4()
		sport, natPort := htons(uint16(1024+i&0x3fff)), htons(uint16(32768+i%32768))
		keys = append(keys,
			masqNat4Key{Saddr: podAddr, Daddr: remote, Sport: sport, Dport: htons(53), Proto: proto, Dir: masqNatDir(Egress)},
			masqNat4Key{Saddr: remote, Daddr: snat, Sport: htons(53), Dport: natPort, Proto: proto, Dir: masqNatDir(Ingress)})
		vals = append(vals,
			enc(masqNatEntry{Addr: addrBytes(snat4), Port: natPort, Kind: masqNatKind(KindMasq), Flags: masqNatFlags(FlagOrig | FlagReplied),
				LastSeen: uint64(lastSeen)}),
			enc(masqNatEntry{Addr: addrBytes(pod4(i >> 14)), Port: sport, Kind: masqNatKind(KindMasq), Flags: masqNatFlags(FlagReplied), Slot: noSlot,
				LastSeen: uint64(lastSeen)}))
		if len(keys) == cap(keys) {
			flush()
		}
	}
	flush()
}

// cpuTime is the CPU time (user and system) the process used so far.
func cpuTime(tb testing.TB) time.Duration {
	tb.Helper()
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// natCount counts the IPv4 NAT table's entries.
func natCount(tb testing.TB, d *Datapath) int {
	tb.Helper()
	n := 0
	if err := d.NATEntries(4, func(NATEntry) bool { n++; return true }); err != nil {
		tb.Fatal(err)
	}
	return n
}

// BenchmarkSweep is the periodic sweep over a full NAT table, of three kinds of flows. live:
// every flow is active, so the sweep only reads the table (its cost every SweepInterval, whatever
// the traffic); idle-tcp: established TCP connections idle for an hour, far from their timeout
// (long-lived idle connections, kept as conntrack keeps them); idle: every flow has expired and
// is removed (the table is refilled outside the timer).
func BenchmarkSweep(b *testing.B) {
	for _, entries := range []int{100_000, 262_144, 2 << 20} {
		for _, kind := range []string{"live", "idle-tcp", "idle"} {
			b.Run(fmt.Sprintf("entries=%d/%s", entries, kind), func(b *testing.B) {
				h := newHarness(b, defaultPolicy(true), LoadOptions{NATEntries: uint32(max(entries, 1<<18))})
				now := MonotonicNow() + 2*time.Hour // room for the past
				seen, proto := now, uint8(unix.IPPROTO_UDP)
				switch kind {
				case "idle-tcp":
					seen, proto = now-time.Hour, unix.IPPROTO_TCP
				case "idle":
					seen = now - time.Hour
				}
				fill := func() {
					fillFlowsOf(b, h.dp.objs.NatV4, proto, 0, entries/2, seen, func(e masqNatEntry) masqNatEntry { return e })
				}
				fill()
				have := natCount(b, h.dp)
				b.ReportMetric(float64(have), "entries")
				var cpu time.Duration
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if kind == "idle" && i > 0 {
						b.StopTimer()
						fill()
						have = natCount(b, h.dp) // a refilled LRU table may evict a few
						b.StartTimer()
					}
					before := cpuTime(b)
					res, err := h.dp.Sweep(now, DefaultTimeouts)
					cpu += cpuTime(b) - before
					if err != nil {
						b.Fatal(err)
					}
					if kind != "idle" && res.Flows+res.Orphans != 0 {
						b.Fatalf("a table of %s flows lost %+v", kind, res)
					}
					if kind == "idle" && 2*res.Flows+res.Orphans != have {
						b.Fatalf("removed %+v of %d idle entries", res.Swept, have)
					}
				}
				// CPU time, user and kernel (the map syscalls), is what a sweep costs the node; wall
				// time also counts waiting for a CPU on a busy machine.
				b.ReportMetric(float64(cpu.Microseconds())/1000/float64(b.N), "cpu-ms/op")
			})
		}
	}
}
