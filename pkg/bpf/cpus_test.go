package bpf

import (
	"fmt"
	"net/netip"
	"sync/atomic"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// The programs on two CPUs at once: BPF_PROG_TEST_RUN runs a program on its caller's CPU, so two
// threads pinned to different CPUs (nsRunner.onCPUs) run the same flow's packets at the same
// moment, flow after flow in lockstep, as a multi-queue NIC and the transmit paths of two
// sockets do. Conntrack is the reference: a flow has one mapping whichever CPU sees its packets,
// and each of its events happens once.

const (
	evNewMasq   = Event(masqEventEV_NEW_MASQ)
	evConfirmed = Event(masqEventEV_CONFIRMED)
)

// raceFlows is how many flows each race runs: the windows between two map operations are a few
// hundred ns, hit by a fraction of the flows.
const raceFlows = 3000

// lockstep runs steps[c](i) on CPU c for i from 0 to n-1, every CPU starting step i only once
// each has finished step i-1, so that the CPUs run each step at the same moment; it returns the
// first errors of each CPU.
func (h *harness) lockstep(t *testing.T, n int, steps ...func(i int) error) error {
	t.Helper()
	started := make([]atomic.Int64, len(steps))
	fns := make([]func() error, len(steps))
	for c, step := range steps {
		fns[c] = func() error {
			var errs []error
			for i := range n {
				started[c].Store(int64(i + 1))
				for o := range started {
					for started[o].Load() < int64(i+1) {
					}
				}
				if err := step(i); err != nil && len(errs) < 5 {
					errs = append(errs, fmt.Errorf("CPU %d, flow %d: %w", c, i, err))
				}
			}
			return joinErrs(errs)
		}
	}
	return h.ns.onCPUs(t, fns...)
}

func joinErrs(errs []error) error {
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("%v", errs)
}

// raceRun runs prog on frame on the calling thread (one of lockstep's) and returns the packet it
// let pass, or an error for any other verdict.
func raceRun(prog *ebpf.Program, frame []byte) (tuple, error) {
	ret, out, err := runCtxErr(prog, frame, forwarded)
	if err != nil {
		return tuple{}, err
	}
	if ret != tcNext {
		return tuple{}, fmt.Errorf("verdict %d", int32(ret))
	}
	p := parseFuzz(out)
	return tuple{proto: p.proto, src: netip.AddrPortFrom(p.src, p.sport), dst: netip.AddrPortFrom(p.dst, p.dport)}, nil
}

// raceExchange runs a packet of flow (pod end, remote end, NAT end) each way: the pod's must leave
// from the flow's NAT end, the reply must arrive at the pod.
func (h *harness) raceExchange(podEnd, dst, nat netip.AddrPort, out, back []byte) error {
	got, err := raceRun(h.dp.Egress(), out)
	if err != nil {
		return fmt.Errorf("egress: %w", err)
	}
	if got.src != nat {
		return fmt.Errorf("the pod's packet left from %s, the flow's mapping is %s", got.src, nat)
	}
	if got, err = raceRun(h.dp.Ingress(), back); err != nil {
		return fmt.Errorf("ingress: %w", err)
	}
	if got.dst != podEnd {
		return fmt.Errorf("the reply arrived at %s, want the pod's %s", got.dst, podEnd)
	}
	return nil
}

// checkFlowsOnce fails unless the family's tables hold exactly 2 entries per flow, each key once,
// all in table tbl, and the events counted each flow once.
func (h *harness) checkFlowsOnce(t *testing.T, tbl Table, events map[Event]uint64) {
	t.Helper()
	seen := map[string]int{}
	var in [3]int
	if err := h.dp.NATEntries(policy.IPv4, func(e NATEntry) bool {
		seen[fmt.Sprint(e.Dir, e.Proto, e.Src, e.Dst)]++
		in[e.Table]++
		return true
	}); err != nil {
		t.Fatal(err)
	}
	dup := 0
	for _, n := range seen {
		dup += n - 1
	}
	if total := in[TableConfirmed] + in[TableUnreplied]; total != 2*raceFlows || in[tbl] != total || dup != 0 {
		t.Errorf("%d entries for %d flows (%d confirmed, %d unreplied, %d keys twice), want %d, all %s",
			total, raceFlows, in[TableConfirmed], in[TableUnreplied], dup, 2*raceFlows, tbl)
	}
	got := h.events()
	for ev, want := range events {
		if got[ev] != want {
			t.Errorf("%s counted %d times for %d flows, want %d", ev, got[ev], raceFlows, want)
		}
	}
}

// TestTwoCPUsOpen: the first packet of a UDP flow on both CPUs at once makes one mapping, which
// both packets leave by, counted once.
func TestTwoCPUsOpen(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{NATEntries: 1 << 16})
	podEnd := func(i int) netip.AddrPort { return ap(pod4(1+i/1000), uint16(20000+i%1000)) }
	dst := ap(remote4, 53)
	var nat [2][raceFlows]netip.AddrPort
	step := func(c int) func(int) error {
		return func(i int) error {
			got, err := raceRun(h.dp.Egress(), udpPacket(podEnd(i), dst, []byte("q")))
			nat[c][i] = got.src
			return err
		}
	}
	if err := h.lockstep(t, raceFlows, step(0), step(1)); err != nil {
		t.Error(err)
	}
	two := 0
	for i := range raceFlows {
		if nat[0][i] != nat[1][i] {
			two++
		}
	}
	if two > 0 {
		t.Errorf("%d of %d flows left by two mappings", two, raceFlows)
	}
	h.checkFlowsOnce(t, TableUnreplied, map[Event]uint64{evNewMasq: raceFlows})
}

// TestTwoCPUsConfirm: the packets that confirm a flow (its first after the reply) on both CPUs at
// once, each followed by a reply: every packet finds the flow while it moves to the confirmed
// table, leaving by its mapping or arriving at the pod, and the move is counted once. UDP, where
// both halves can confirm, and TCP, where the pod's ACK of the handshake confirms while the
// server's data arrives on the other CPU.
func TestTwoCPUsConfirm(t *testing.T) {
	for _, proto := range []string{"udp", "tcp"} {
		t.Run(proto, func(t *testing.T) {
			h := newHarness(t, defaultPolicy(true), LoadOptions{NATEntries: 1 << 16})
			podEnd := func(i int) netip.AddrPort { return ap(pod4(1+i/1000), uint16(20000+i%1000)) }
			dst := ap(remote4, 443)
			var nat [raceFlows]netip.AddrPort
			for i := range raceFlows {
				if proto == "udp" {
					nat[i] = tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(podEnd(i), dst, []byte("q")))).src
					h.mustPass(h.dp.Ingress(), udpPacket(dst, nat[i], []byte("a")))
				} else {
					nat[i] = tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(podEnd(i), dst, tcpSYN, nil))).src
					h.mustPass(h.dp.Ingress(), tcpPacket(dst, nat[i], tcpSYN|tcpACK, nil))
				}
			}
			before := h.events()
			step := func(c int) func(int) error {
				return func(i int) error {
					if proto == "udp" {
						return h.raceExchange(podEnd(i), dst, nat[i], udpPacket(podEnd(i), dst, []byte("q")),
							udpPacket(dst, nat[i], []byte("a")))
					}
					if c == 0 { // the handshake's ACK, then a request
						return h.raceExchange(podEnd(i), dst, nat[i], tcpPacket(podEnd(i), dst, tcpACK, nil),
							tcpPacket(dst, nat[i], tcpACK, []byte("a")))
					}
					// the server's first data, then the pod's request
					got, err := raceRun(h.dp.Ingress(), tcpPacket(dst, nat[i], tcpACK, []byte("hello")))
					if err == nil && got.dst != podEnd(i) {
						err = fmt.Errorf("the server's data arrived at %s, want the pod's %s", got.dst, podEnd(i))
					}
					if err != nil {
						return err
					}
					return h.raceExchange(podEnd(i), dst, nat[i], tcpPacket(podEnd(i), dst, tcpACK, []byte("q")),
						tcpPacket(dst, nat[i], tcpACK, []byte("a")))
				}
			}
			if err := h.lockstep(t, raceFlows, step(0), step(1)); err != nil {
				t.Error(err)
			}
			h.checkFlowsOnce(t, TableConfirmed, map[Event]uint64{
				evNewMasq:   before[evNewMasq],
				evConfirmed: before[evConfirmed] + raceFlows,
			})
		})
	}
}
