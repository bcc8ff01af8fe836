package bench

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/test/e2e"
)

// The agent's NAT tables filled with TCP connections through the agent's own programs: for each
// connection the pod's SYN, the remote's SYN-ACK and the pod's ACK (which confirms the flow) run
// through the programs attached to the node's uplink with BPF_PROG_TEST_RUN, inside the node's
// namespace, as the packets would come: the SYN and the ACK forwarded from the pod's device with
// the uplink's MAC as their source, the SYN-ACK arriving on the uplink. So every entry is written
// by the programs themselves (port allocation, both halves, the move to the confirmed table), at
// a few microseconds per connection, where a million real connections through veths would take
// minutes and hold as many sockets.

// skbContext is the head of struct __sk_buff up to ifindex, as BPF_PROG_TEST_RUN takes it.
type skbContext struct {
	Len, PktType, Mark, QueueMapping, Protocol, VlanPresent, VlanTCI, VlanProto, Priority uint32
	IngressIfindex, Ifindex                                                               uint32
}

// tcxNext is TCX_NEXT (-1): the programs' verdict for a packet they pass on.
const tcxNext = ^uint32(0)

// flowFiller runs the agent's programs on handshakes.
type flowFiller struct {
	egress, ingress *ebpf.Program
	uplink, pod     uint32 // ifindexes in the node
	mac             net.HardwareAddr
	nodeAddr        netip.Addr
}

// newFlowFiller finds the programs the agent attached to the node's uplink (tcx).
func newFlowFiller(b *testing.B, env *e2e.Env) *flowFiller {
	b.Helper()
	f := &flowFiller{nodeAddr: e2e.NodeAddr4}
	err := testutil.Do(env.Node, func() error {
		up, err := net.InterfaceByName(e2e.Uplink)
		if err != nil {
			return err
		}
		pod, err := net.InterfaceByName("pod0")
		if err != nil {
			return err
		}
		f.uplink, f.pod, f.mac = uint32(up.Index), uint32(pod.Index), up.HardwareAddr
		for _, hook := range []struct {
			attach ebpf.AttachType
			prog   **ebpf.Program
		}{{ebpf.AttachTCXEgress, &f.egress}, {ebpf.AttachTCXIngress, &f.ingress}} {
			res, err := link.QueryPrograms(link.QueryOptions{Target: up.Index, Attach: hook.attach})
			if err != nil {
				return err
			}
			if len(res.Programs) != 1 {
				return fmt.Errorf("%d programs on the uplink's %v, want the agent's one", len(res.Programs), hook.attach)
			}
			if *hook.prog, err = ebpf.NewProgramFromID(res.Programs[0].ID); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		b.Fatalf("the agent's programs on the uplink: %v", err)
	}
	b.Cleanup(func() {
		f.egress.Close()
		f.ingress.Close()
	})
	return f
}

// flowEnds are the pod and remote ends of the i-th connection: pods 10.244.1.2 and up (routed to
// the pod's device), 60,000 source ports each; remotes 198.18.0.0/15 (masqueraded by the default
// policy), port 443, 16,384 connections each, so that port claims stay cheap.
func flowEnds(i int) (pod, remote netip.AddrPort) {
	p := 2 + i/60000
	pod = netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244, byte(1 + p/250), byte(p % 250)}), uint16(1024+i%60000))
	r := i / 16384
	remote = netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, byte(r >> 8), byte(r)}), 443)
	return pod, remote
}

// fill runs the handshakes of connections from to from+n-1 on workers goroutines (each on a
// thread in the node's namespace).
func (f *flowFiller) fill(ns string, from, n, workers int) error {
	var wg sync.WaitGroup
	errs := make([]error, workers)
	per := (n + workers - 1) / workers
	for w := range workers {
		lo, hi := from+w*per, min(from+(w+1)*per, from+n)
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[w] = testutil.Do(ns, func() error {
				for i := lo; i < hi; i++ {
					if err := f.handshake(flowEnds(i)); err != nil {
						return fmt.Errorf("connection %d: %w", i, err)
					}
				}
				return nil
			})
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// TCP flags.
const (
	tcpFIN = 0x01
	tcpSYN = 0x02
	tcpRST = 0x04
	tcpACK = 0x10
)

// handshake runs one connection's SYN, SYN-ACK and ACK.
func (f *flowFiller) handshake(pod, remote netip.AddrPort) error {
	out := make([]byte, 256)
	syn := tcpFrame(f.mac, peerMAC, pod, remote, tcpSYN, 1000, 0)
	if err := f.run(f.egress, syn, out, f.pod); err != nil {
		return fmt.Errorf("SYN: %w", err)
	}
	natPort := binary.BigEndian.Uint16(out[14+20:])
	nat := netip.AddrPortFrom(f.nodeAddr, natPort)
	if err := f.run(f.ingress, tcpFrame(peerMAC, f.mac, remote, nat, tcpSYN|tcpACK, 5000, 1001), out, f.uplink); err != nil {
		return fmt.Errorf("SYN-ACK: %w", err)
	}
	if got := netip.AddrFrom4([4]byte(out[14+16 : 14+20])); got != pod.Addr() {
		return fmt.Errorf("SYN-ACK to %s:%d translated to %s, not the pod's %s", f.nodeAddr, natPort, got, pod)
	}
	if err := f.run(f.egress, tcpFrame(f.mac, peerMAC, pod, remote, tcpACK, 1001, 5001), out, f.pod); err != nil {
		return fmt.Errorf("ACK: %w", err)
	}
	return nil
}

// run runs prog on frame as a packet that came in on ingress and leaves (or arrived) by the
// uplink; the packet as the program left it lands in out.
func (f *flowFiller) run(prog *ebpf.Program, frame, out []byte, ingress uint32) error {
	opts := ebpf.RunOptions{Data: frame, DataOut: out, Repeat: 1,
		Context: skbContext{IngressIfindex: ingress, Ifindex: f.uplink}}
	ret, err := prog.Run(&opts)
	if err != nil {
		return err
	}
	if ret != tcxNext {
		return fmt.Errorf("verdict %d", ret)
	}
	return nil
}

// peerMAC is the MAC address of the uplink's far side in the frames: the egress frames' destination
// and the ingress frames' source (whose destination is the uplink's own, so that the kernel takes
// them for this host's).
var peerMAC = net.HardwareAddr{0x02, 0, 0, 0, 0, 1}

// tcpFrame is an Ethernet frame holding an IPv4 TCP segment without payload or options, with a
// valid IP header checksum (the TCP checksum the programs only update, never check).
func tcpFrame(srcMAC, dstMAC net.HardwareAddr, src, dst netip.AddrPort, flags uint8, seq, ack uint32) []byte {
	b := make([]byte, 14+20+20)
	copy(b[0:6], dstMAC)
	copy(b[6:12], srcMAC)
	binary.BigEndian.PutUint16(b[12:], 0x0800)
	ip := b[14:34]
	ip[0], ip[8], ip[9] = 0x45, 64, 6
	binary.BigEndian.PutUint16(ip[2:], 40)
	s, d := src.Addr().As4(), dst.Addr().As4()
	copy(ip[12:16], s[:])
	copy(ip[16:20], d[:])
	var sum uint32
	for i := 0; i < 20; i += 2 {
		sum += uint32(binary.BigEndian.Uint16(ip[i:]))
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(ip[10:], ^uint16(sum))
	tcp := b[34:]
	binary.BigEndian.PutUint16(tcp[0:], src.Port())
	binary.BigEndian.PutUint16(tcp[2:], dst.Port())
	binary.BigEndian.PutUint32(tcp[4:], seq)
	binary.BigEndian.PutUint32(tcp[8:], ack)
	tcp[12], tcp[13] = 5<<4, flags
	binary.BigEndian.PutUint16(tcp[14:], 65535)
	return b
}
