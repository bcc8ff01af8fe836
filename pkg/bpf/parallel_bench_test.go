package bpf

import (
	"fmt"
	"testing"
	"time"

	"github.com/cilium/ebpf"
)

// BenchmarkParallel: the programs on one CPU, then on two at once (BPF_PROG_TEST_RUN runs a
// program on its caller's CPU; onCPUs pins each caller to its own), each CPU with flows of its
// own, as the CPUs of a node's queues have. What the CPUs share is then all that can slow one
// down when the other runs too: the NAT tables' hash buckets and, for new flows, the LRU's
// common free list and the port claims; the counters are per CPU. Each CPU runs b.N packets;
// "ns/pkt" is the kernel's mean time per run over all CPUs, "Mpkt/s" the packets of all CPUs
// per second of wall time (the syscall around each run included). The scaling ratio is the
// second's 2-CPU figure over its 1-CPU one (perfect: 2.00); ns/pkt that grows with CPUs is
// contention inside the programs.
func BenchmarkParallel(b *testing.B) {
	for _, kind := range []string{"established", "reply", "new-flow"} {
		for _, cpus := range []int{1, 2} {
			b.Run(fmt.Sprintf("%s/cpus=%d", kind, cpus), func(b *testing.B) {
				h := benchHarness(b, 1)
				progs := make([]*ebpf.Program, cpus)
				frames := make([]func(i int) []byte, cpus)
				for c := range cpus {
					// CPU c's flows come from pods 64c+1 and up: no two CPUs share a flow.
					pod := 64*c + 1
					switch kind {
					case "established":
						end := ap(pod4(pod), 40000)
						h.established(end, ap(remote4, 443))
						frame := tcpPacket(end, ap(remote4, 443), tcpACK, make([]byte, 64))
						progs[c], frames[c] = h.dp.Egress(), func(int) []byte { return frame }
					case "reply":
						nat := h.established(ap(pod4(pod), 40000), ap(remote4, 443))
						frame := tcpPacket(ap(remote4, 443), nat, tcpACK, make([]byte, 64))
						progs[c], frames[c] = h.dp.Ingress(), func(int) []byte { return frame }
					case "new-flow":
						progs[c], frames[c] = h.dp.Egress(), func(i int) []byte {
							return tcpPacket(ap(pod4(pod+i>>14), uint16(1024+i&0x3fff)), ap(remoteN(i), 443), tcpSYN, nil)
						}
					}
				}
				kernel := make([]time.Duration, cpus)
				fns := make([]func() error, cpus)
				for c := range cpus {
					fns[c] = func() error {
						for i := range b.N {
							ret, d, err := benchRun(progs[c], frames[c](i))
							if err != nil {
								return err
							}
							if ret != tcNext {
								return fmt.Errorf("CPU %d, packet %d: verdict %d, want %d", c, i, ret, tcNext)
							}
							kernel[c] += d
						}
						return nil
					}
				}
				b.ResetTimer()
				start := time.Now()
				if err := h.ns.onCPUs(b, fns...); err != nil {
					b.Fatal(err)
				}
				wall := time.Since(start)
				var total time.Duration
				for _, d := range kernel {
					total += d
				}
				b.ReportMetric(float64(total.Nanoseconds())/float64(cpus*b.N), "ns/pkt")
				b.ReportMetric(float64(cpus*b.N)/wall.Seconds()/1e6, "Mpkt/s")
			})
		}
	}
}
