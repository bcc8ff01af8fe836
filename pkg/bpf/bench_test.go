package bpf

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"testing"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"golang.org/x/sys/unix"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// The benchmarks report "ns/pkt": the time the kernel measured inside BPF_PROG_TEST_RUN for one
// run of the program (ns/op also holds the syscall around it). Each run gets a fresh copy of the
// packet (Repeat 1), because the programs rewrite packets in place.

var benchSizes = []int{1, 64, 1_000, 10_000, 100_000}

// benchPolicy has n non-masquerade CIDRs (10.0.0.0/8 first, then random prefixes of 11.0.0.0/8
// up to 126.0.0.0/8, /12 to /32) and masquerades everything else.
func benchPolicy(n int) *policy.Policy {
	rng := rand.New(rand.NewPCG(uint64(n), 42))
	seen := map[netip.Prefix]bool{netip.MustParsePrefix("10.0.0.0/8"): true}
	cidrs := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}
	for len(cidrs) < n {
		var b [4]byte
		binary.BigEndian.PutUint32(b[:], rng.Uint32())
		b[0] = byte(11 + rng.IntN(116))
		p, _ := netip.AddrFrom4(b).Prefix(12 + rng.IntN(21))
		if !seen[p] {
			seen[p] = true
			cidrs = append(cidrs, p)
		}
	}
	cfg := config.Config{NonMasqueradeCIDRs: cidrs, MasqOutBound: true, MasqOutBoundIPv6: true}
	return policy.Compile(cfg, policy.Options{EnableIPv6: true, RandomFully: true})
}

func benchHarness(b *testing.B, cidrs int) *harness {
	b.Helper()
	return newHarness(b, benchPolicy(cidrs), LoadOptions{MaxRules: 1 << 17, NATEntries: 1 << 20})
}

// measure runs prog once per iteration on frame(i), and reports the kernel's time per run. The
// whole loop runs on the harness namespace's thread: a hop to it per run would move the program
// between CPUs and measure cold caches.
func measure(b *testing.B, h *harness, prog *ebpf.Program, want uint32, frame func(i int) []byte) {
	b.Helper()
	var (
		total time.Duration
		err   error
	)
	b.ResetTimer()
	h.ns.do(func() {
		for i := 0; i < b.N && err == nil; i++ {
			ret, d, rerr := benchRun(prog, frame(i))
			switch {
			case rerr != nil:
				err = rerr
			case ret != want:
				err = fmt.Errorf("verdict %d, want %d", ret, want)
			}
			total += d
		}
	})
	if err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(total.Nanoseconds())/float64(b.N), "ns/pkt")
}

// benchRun runs prog once on frame as a forwarded packet (see forwarded) and returns its verdict
// and the time the kernel measured for the run: ebpf.Program.Benchmark takes no context, and
// ebpf.Program.Run returns no time.
func benchRun(prog *ebpf.Program, frame []byte) (uint32, time.Duration, error) {
	return benchRunOut(prog, frame, nil)
}

// benchRunOut is benchRun that also copies the packet as the program left it into out (which
// must hold it), when out is not nil.
func benchRunOut(prog *ebpf.Program, frame, out []byte) (uint32, time.Duration, error) {
	ctx := forwarded.forRun()
	attr := struct {
		progFD, retval, dataSizeIn, dataSizeOut uint32
		dataIn, dataOut                         uint64
		repeat, duration                        uint32
		ctxSizeIn, ctxSizeOut                   uint32
		ctxIn, ctxOut                           uint64
		flags, cpu, batchSize, _                uint32
	}{
		progFD: uint32(prog.FD()), dataSizeIn: uint32(len(frame)), dataIn: uint64(uintptr(unsafe.Pointer(&frame[0]))),
		repeat: 1, ctxSizeIn: uint32(unsafe.Sizeof(ctx)), ctxIn: uint64(uintptr(unsafe.Pointer(&ctx))),
	}
	if out != nil {
		attr.dataSizeOut, attr.dataOut = uint32(len(out)), uint64(uintptr(unsafe.Pointer(&out[0])))
	}
	_, _, errno := unix.Syscall(unix.SYS_BPF, unix.BPF_PROG_TEST_RUN, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr))
	runtime.KeepAlive(frame)
	runtime.KeepAlive(out)
	runtime.KeepAlive(&ctx)
	if errno != 0 {
		return 0, 0, fmt.Errorf("BPF_PROG_TEST_RUN: %w", errno)
	}
	return attr.retval, time.Duration(attr.duration), nil
}

// remoteN is the n-th remote address of 198.18.0.0/15, masqueraded by benchPolicy.
func remoteN(n int) netip.Addr {
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], 0xc6120000|uint32(n&0x1ffff))
	return netip.AddrFrom4(b)
}

// established opens a masqueraded TCP flow with a handshake (so that it is confirmed) and
// returns its NAT end.
func (h *harness) established(podEnd, dst netip.AddrPort) netip.AddrPort {
	h.t.Helper()
	nat := tupleOf(h.t, h.mustPass(h.dp.Egress(), tcpPacket(podEnd, dst, tcpSYN, nil))).src
	h.mustPass(h.dp.Ingress(), tcpPacket(dst, nat, tcpSYN|tcpACK, nil))
	h.mustPass(h.dp.Egress(), tcpPacket(podEnd, dst, tcpACK, nil))
	return nat
}

// BenchmarkEgressEstablished: a packet of a known flow, translated from the NAT table.
func BenchmarkEgressEstablished(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(fmt.Sprintf("cidrs=%d", n), func(b *testing.B) {
			h := benchHarness(b, n)
			h.established(ap(pod4(1), 40000), ap(remote4, 443))
			frame := tcpPacket(ap(pod4(1), 40000), ap(remote4, 443), tcpACK, make([]byte, 64))
			measure(b, h, h.dp.Egress(), tcNext, func(int) []byte { return frame })
		})
	}
}

// BenchmarkEgressNewFlow: the first packet of a masqueraded flow: table miss, both tries, the
// outbound rule, a port claim and the two new entries.
func BenchmarkEgressNewFlow(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(fmt.Sprintf("cidrs=%d", n), func(b *testing.B) {
			h := benchHarness(b, n)
			measure(b, h, h.dp.Egress(), tcNext, func(i int) []byte {
				return tcpPacket(ap(pod4(i>>14), uint16(1024+i&0x3fff)), ap(remoteN(i), 443), tcpSYN, nil)
			})
		})
	}
}

// BenchmarkEgressNewDatagram: the first datagram of a masqueraded UDP flow: as a new TCP flow's
// SYN, and the look-ups a datagram of no known flow makes besides, for a connection from outside
// whose egress half was evicted and for one to an address the node translated (inbound_v4).
func BenchmarkEgressNewDatagram(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(fmt.Sprintf("cidrs=%d", n), func(b *testing.B) {
			h := benchHarness(b, n)
			measure(b, h, h.dp.Egress(), tcNext, func(i int) []byte {
				return udpPacket(ap(pod4(i>>14), uint16(1024+i&0x3fff)), ap(remoteN(i), 53), payload)
			})
		})
	}
}

// BenchmarkConnection: every packet of a short masqueraded TCP connection whose server closes
// first, as the end-to-end short-connection load makes them, each step's cost reported on its
// own: the SYN (the new flow), the SYN-ACK (its first reply), the handshake's ACK (the move to the
// confirmed table), a request and its response (established), the server's FIN, the pod's FIN
// and the last ACK (both marked closing). The sum is what the programs cost one connection.
func BenchmarkConnection(b *testing.B) {
	steps := []struct {
		name    string
		ingress bool
		flags   int
		data    int
	}{
		{"syn", false, tcpSYN, 0}, {"synack", true, tcpSYN | tcpACK, 0}, {"ack", false, tcpACK, 0},
		{"request", false, tcpACK, 64}, {"response", true, tcpACK, 64},
		{"server-fin", true, tcpFIN | tcpACK, 0}, {"pod-fin", false, tcpFIN | tcpACK, 0}, {"last-ack", true, tcpACK, 0},
	}
	for _, n := range []int{1, 100_000} {
		b.Run(fmt.Sprintf("cidrs=%d", n), func(b *testing.B) {
			h := benchHarness(b, n)
			total := make([]time.Duration, len(steps))
			out := make([]byte, 256)
			var err error
			b.ResetTimer()
			h.ns.do(func() {
				for i := 0; i < b.N && err == nil; i++ {
					pod, remote := ap(pod4(i>>14), uint16(1024+i&0x3fff)), ap(remoteN(i), 443)
					var nat netip.AddrPort
					for j, st := range steps {
						prog, frame := h.dp.Egress(), tcpPacket(pod, remote, st.flags, make([]byte, st.data))
						if st.ingress {
							prog, frame = h.dp.Ingress(), tcpPacket(remote, nat, st.flags, make([]byte, st.data))
						}
						ret, d, rerr := benchRunOut(prog, frame, out)
						switch {
						case rerr != nil:
							err = rerr
						case ret != tcNext:
							err = fmt.Errorf("%s: verdict %d, want %d", st.name, ret, tcNext)
						}
						if err != nil {
							break
						}
						if j == 0 {
							nat = tupleOf(b, out[:len(frame)]).src
						}
						total[j] += d
					}
				}
			})
			if err != nil {
				b.Fatal(err)
			}
			var sum time.Duration
			for j, st := range steps {
				b.ReportMetric(float64(total[j].Nanoseconds())/float64(b.N), st.name+"-ns")
				sum += total[j]
			}
			b.ReportMetric(float64(sum.Nanoseconds())/float64(b.N), "ns/conn")
		})
	}
}

// BenchmarkIngressReverse: a reply to a mapping, translated back to the pod.
func BenchmarkIngressReverse(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(fmt.Sprintf("cidrs=%d", n), func(b *testing.B) {
			h := benchHarness(b, n)
			nat := h.established(ap(pod4(1), 40000), ap(remote4, 443))
			reply := tcpPacket(ap(remote4, 443), nat, tcpACK, make([]byte, 64))
			measure(b, h, h.dp.Ingress(), tcNext, func(int) []byte { return reply })
		})
	}
}

// BenchmarkEgressReturn: a packet of a flow the policy leaves alone, after its first: its kept
// verdict is found in keep_v4 (never the NAT tables, which pod-to-pod traffic would crowd out).
func BenchmarkEgressReturn(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(fmt.Sprintf("cidrs=%d", n), func(b *testing.B) {
			h := benchHarness(b, n)
			frame := tcpPacket(ap(pod4(1), 40000), ap(netip.MustParseAddr("10.20.30.40"), 443), tcpACK, make([]byte, 64))
			measure(b, h, h.dp.Egress(), tcNext, func(int) []byte { return frame })
		})
	}
}

// BenchmarkIngressReturn: a reply of a flow the policy leaves alone, as pod-to-pod traffic across
// nodes is: no mapping, its kept verdict refreshed (keep_v4).
func BenchmarkIngressReturn(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(fmt.Sprintf("cidrs=%d", n), func(b *testing.B) {
			h := benchHarness(b, n)
			podEnd, dst := ap(pod4(1), 40000), ap(netip.MustParseAddr("10.20.30.40"), 443)
			h.mustPass(h.dp.Egress(), tcpPacket(podEnd, dst, tcpSYN, nil))
			reply := tcpPacket(dst, podEnd, tcpACK, make([]byte, 64))
			measure(b, h, h.dp.Ingress(), tcNext, func(int) []byte { return reply })
		})
	}
}

// BenchmarkTestRunFloor: a program that returns TC_NEXT at once, measured as the paths above
// are: what BPF_PROG_TEST_RUN itself adds to each run (a clock read and softirq masking inside
// the timed span), which every ns/pkt above includes and no packet on the wire pays.
func BenchmarkTestRunFloor(b *testing.B) {
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SchedCLS, License: "Dual BSD/GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()}})
	if err != nil {
		b.Fatal(err)
	}
	defer prog.Close()
	h := benchHarness(b, 1)
	frame := tcpPacket(ap(pod4(1), 40000), ap(remote4, 443), tcpACK, make([]byte, 64))
	measure(b, h, prog, tcNext, func(int) []byte { return frame })
}

// BenchmarkSyncPolicy: a resync that changes 1% of the CIDRs.
func BenchmarkSyncPolicy(b *testing.B) {
	for _, n := range benchSizes[1:] {
		b.Run(fmt.Sprintf("cidrs=%d", n), func(b *testing.B) {
			h := benchHarness(b, n)
			p := [2]*policy.Policy{benchPolicy(n), benchPolicy(n)}
			rules := p[1].IPv4 // link-local, 10/8, the random CIDRs, outbound
			for i := 2; i < len(rules)-1; i += 100 {
				rules[i].Prefix = netip.PrefixFrom(netip.AddrFrom4([4]byte{127, byte(i >> 16), byte(i >> 8), byte(i)}), 32)
			}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := h.dp.SyncPolicy(p[(i+1)%2]); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkSyncPolicyReplace: every CIDR replaced by another (the config apply benchmark's
// "replace" step, without the agent around it).
func BenchmarkSyncPolicyReplace(b *testing.B) {
	for _, n := range benchSizes[1:] {
		b.Run(fmt.Sprintf("cidrs=%d", n), func(b *testing.B) {
			// Room for both policies at once, as the backend sizes the maps (CapacityFor).
			h := newHarness(b, benchPolicy(n), LoadOptions{MaxRules: CapacityFor(n + 2), NATEntries: 1 << 10})
			p := [2]*policy.Policy{benchPolicy(n), benchPolicy(n + 1)}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := h.dp.SyncPolicy(p[(i+1)%2]); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// sourceBenchPolicy is benchPolicy(1) with rules source rules, each holding a /24 of
// 100.64.0.0/10 and, as a selector rule, its share of pods /32 entries (pod4(0) on): its own
// non-masquerade list (10.0.0.0/8 and a /16 of its own) and the outbound rule.
func sourceBenchPolicy(rules, pods int) *policy.Policy {
	cfg := config.Config{NonMasqueradeCIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, MasqOutBound: true}
	opts := policy.Options{RandomFully: true, Pods: map[string][]netip.Addr{}}
	for i := range rules {
		r := config.SourceRule{Name: fmt.Sprintf("rule%d", i), PodSelector: &metav1.LabelSelector{},
			CIDRs: []netip.Prefix{netip.PrefixFrom(netip.AddrFrom4([4]byte{100, byte(64 + i/256), byte(i), 0}), 24)},
			Set:   []string{config.KeyNonMasqueradeCIDRs}}
		r.Own.NonMasqueradeCIDRs = []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"),
			netip.PrefixFrom(netip.AddrFrom4([4]byte{11, byte(i / 256), byte(i), 0}), 24)}
		cfg.SourceRules = append(cfg.SourceRules, r)
	}
	for k := range pods {
		name := cfg.SourceRules[k%rules].Name
		opts.Pods[name] = append(opts.Pods[name], pod4(k))
	}
	return policy.Compile(cfg, opts)
}

// BenchmarkSourceRules: a new flow from a pod that a source rule holds by its /32 entry (the
// source trie, then the rule's tries and settings), and a packet of an established flow (which
// looks none of them up), by the number of source rules and pod entries; rules=0 is the global
// lists alone.
func BenchmarkSourceRules(b *testing.B) {
	for _, size := range []struct{ rules, pods int }{{0, 0}, {1, 1}, {1, 250}, {1000, 1}, {1000, 250}} {
		p := benchPolicy(1)
		if size.rules > 0 {
			p = sourceBenchPolicy(size.rules, size.pods)
		}
		pods := max(size.pods, 1)
		b.Run(fmt.Sprintf("new/rules=%d/pods=%d", size.rules, size.pods), func(b *testing.B) {
			h := newHarness(b, p, LoadOptions{MaxRules: 1 << 14, NATEntries: 1 << 20})
			measure(b, h, h.dp.Egress(), tcNext, func(i int) []byte {
				return tcpPacket(ap(pod4(i%pods), uint16(1024+(i/pods)&0x3fff)), ap(remoteN(i), 443), tcpSYN, nil)
			})
		})
		b.Run(fmt.Sprintf("established/rules=%d/pods=%d", size.rules, size.pods), func(b *testing.B) {
			h := newHarness(b, p, LoadOptions{MaxRules: 1 << 14, NATEntries: 1 << 20})
			h.established(ap(pod4(0), 40000), ap(remote4, 443))
			frame := tcpPacket(ap(pod4(0), 40000), ap(remote4, 443), tcpACK, make([]byte, 64))
			measure(b, h, h.dp.Egress(), tcNext, func(int) []byte { return frame })
		})
	}
}
