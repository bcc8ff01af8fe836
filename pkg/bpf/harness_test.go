package bpf

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"net"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"sync"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf/bpftest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Each test drives the real programs through BPF_PROG_TEST_RUN: build a packet, run the entry
// point, check the verdict, the bytes and the maps. The kernel runs test packets on the
// loopback device of the caller's namespace, so skb->ifindex is 1 and that is the uplink the
// tests configure; nothing is attached anywhere and no packet leaves the test.
//
// The programs run in a namespace of the harness's own, whose routes are what the ingress
// program's bpf_fib_lookup consults: the pod networks (pod4, pod6) are behind a device "pods",
// 203.0.113.0/24 and 2001:db8:7777::/48 go back out lo (the uplink the packets come by), and
// everything else goes out "up0", a second uplink.

const (
	testIfindex = 1
	// tcNext is TC_ACT_UNSPEC (TCX_NEXT, -1): the verdict that lets the next program of the hook
	// run. tcActOK (TCX_PASS) would end the chain; no path of ours returns it.
	tcNext    = ^uint32(0)
	tcActShot = 2
)

var (
	snat4 = netip.MustParseAddr("192.0.2.1")
	snat6 = netip.MustParseAddr("2001:db8::1")
)

func snatFor(a netip.Addr) netip.Addr {
	if a.Is4() {
		return snat4
	}
	return snat6
}

// harness is a loaded datapath with a policy and the test uplink.
type harness struct {
	t  testing.TB
	dp *Datapath
	p  *policy.Policy
	ns *nsRunner
}

// nsRunner runs functions on a thread inside a network namespace, one at a time (do), or on
// threads of their own, one per CPU, at once (onCPUs).
type nsRunner struct {
	name string
	work chan func()
}

// newNSRunner creates a namespace with the harness's routes and a thread inside it; both go when
// the test ends.
func newNSRunner(t testing.TB) *nsRunner {
	t.Helper()
	ns := testutil.NewNetns(t)
	if err := testutil.IPBatch(context.Background(), ns, `link set lo up
link add up0 type veth peer name up0-peer
link set up0 up
link set up0-peer up
link add pods type veth peer name pods-peer
link set pods up
link set pods-peer up
route add default dev up0
route add ::/0 dev up0
route add 10.1.0.0/16 dev pods
route add fd00::/16 dev pods
route add 203.0.113.0/24 dev lo
route add 2001:db8:7777::/48 dev lo
`); err != nil {
		t.Fatalf("harness namespace: %v", err)
	}
	r := &nsRunner{name: ns, work: make(chan func())}
	ready := make(chan error, 1)
	go func() {
		_ = testutil.Do(ns, func() error {
			for _, f := range []string{"ipv4/ip_forward", "ipv6/conf/all/forwarding"} {
				if err := os.WriteFile("/proc/sys/net/"+f, []byte("1"), 0o644); err != nil {
					ready <- err
					return nil
				}
			}
			ready <- nil
			for f := range r.work {
				f()
			}
			return nil
		})
	}()
	if err := <-ready; err != nil {
		t.Fatalf("harness namespace: %v", err)
	}
	t.Cleanup(func() { close(r.work) })
	return r
}

// do runs f inside the namespace.
func (r *nsRunner) do(f func()) {
	done := make(chan struct{})
	r.work <- func() { defer close(done); f() }
	<-done
}

// onCPUs runs each fn at once on a thread of its own inside the namespace, the i-th pinned to
// CPU i, and returns their errors joined once all have returned: BPF_PROG_TEST_RUN runs a program
// on the CPU of its caller, so this is how two CPUs run the programs at the same time.
func (r *nsRunner) onCPUs(t testing.TB, fns ...func() error) error {
	t.Helper()
	if n := runtime.NumCPU(); n < len(fns) {
		testutil.Unavailable(t, "%d CPUs, the test needs %d", n, len(fns))
	}
	errs := make([]error, len(fns))
	var wg sync.WaitGroup
	for i, fn := range fns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = testutil.Do(r.name, func() error {
				var was, set unix.CPUSet
				if err := unix.SchedGetaffinity(0, &was); err != nil {
					return err
				}
				set.Set(i)
				if err := unix.SchedSetaffinity(0, &set); err != nil {
					return fmt.Errorf("pin to CPU %d: %w", i, err)
				}
				// The thread goes back to the runtime afterwards: pinned, it would hold later
				// goroutines to one CPU.
				defer unix.SchedSetaffinity(0, &was)
				return fn()
			})
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// ifindex is the index of a device of the namespace.
func (r *nsRunner) ifindex(t testing.TB, name string) int {
	t.Helper()
	var idx int
	var err error
	r.do(func() {
		var ifc *net.Interface
		if ifc, err = net.InterfaceByName(name); err == nil {
			idx = ifc.Index
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	return idx
}

// defaultPolicy is the stock configuration with IPv6 enabled: RFC 1918 stays, the rest of IPv4
// and all of IPv6 (but link-local) is masqueraded.
func defaultPolicy(randomFully bool) *policy.Policy {
	return policy.Compile(config.Default(config.Options{EnableIPv6: true}),
		policy.Options{EnableIPv6: true, RandomFully: randomFully})
}

func newHarness(t testing.TB, p *policy.Policy, opts LoadOptions) *harness {
	t.Helper()
	testutil.RequirePrivileged(t, "ip")
	ns := newNSRunner(t)
	if opts.NATEntries == 0 {
		// Room for every test's flows, a sixteenth of the agent's default: the tables are
		// preallocated, and zeroing the default's hundred megabytes for each test is most of
		// its time under a kernel of the matrix emulated in QEMU.
		opts.NATEntries = testNATEntries
	}
	dp, err := Load(opts)
	if errors.Is(err, ebpf.ErrNotSupported) {
		testutil.Unavailable(t, "kernel lacks a BPF feature the datapath needs: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dp.Close() })
	if p != nil {
		if err := dp.SyncPolicy(p); err != nil {
			t.Fatal(err)
		}
	}
	for _, idx := range []int{testIfindex, ns.ifindex(t, "up0")} {
		if _, err := dp.SetUplink(idx, Uplink{IPv4: snat4, IPv6: snat6}); err != nil {
			t.Fatal(err)
		}
	}
	return &harness{t: t, dp: dp, p: p, ns: ns}
}

// testNATEntries is newHarness's NATEntries where a test asks for none.
const testNATEntries = DefaultNATEntries / 16

// skbContext is the head of struct __sk_buff up to cb, as BPF_PROG_TEST_RUN takes it: a test
// may set mark, priority, ingress_ifindex and ifindex (the device, which must exist when it is
// more than 1), and the rest must stay zero (runCtxErr moves ingress_ifindex to cb[0] where
// the kernel cannot set it).
type skbContext struct {
	Len, PktType, Mark, QueueMapping, Protocol, VlanPresent, VlanTCI, VlanProto, Priority uint32
	IngressIfindex, Ifindex, TcIndex                                                      uint32
	Cb                                                                                    [5]uint32
}

// forRun is ctx as BPF_PROG_TEST_RUN takes it on this kernel: ingress_ifindex moved to cb[0]
// where the kernel cannot set it (testIngressInCB).
func (ctx skbContext) forRun() skbContext {
	if testIngressInCB {
		ctx.Cb[0], ctx.IngressIfindex = ctx.IngressIfindex, 0
	}
	return ctx
}

// podDevice stands for the node's device of a pod: the programs only test that a packet's
// ingress_ifindex is not 0, so it need not exist.
const podDevice = 1000

// forwarded is the context of the tests' packets: received on a pod's device and routed out by
// the node, what the programs masquerade (bpf/scope.h). A packet sent by the node itself has
// ingress_ifindex 0.
var forwarded = skbContext{IngressIfindex: podDevice}

// Where this kernel's BPF_PROG_TEST_RUN cannot set ingress_ifindex (bpftest.RunSetsIngressIfindex),
// the tests' packets carry it in cb[0] instead, and the datapath is loaded to read it there
// (testIngressInCB).
func init() { testIngressInCB = !bpftest.RunSetsIngressIfindex() }

// realTraffic makes the datapaths a test loads read ingress_ifindex where the kernel sets it, for
// the real packets of programs attached to devices, until the test ends (no test of this package
// runs in parallel with another).
func realTraffic(t testing.TB) {
	was := testIngressInCB
	testIngressInCB = false
	t.Cleanup(func() { testIngressInCB = was })
}

func runProg(t testing.TB, prog *ebpf.Program, frame []byte) (uint32, []byte) {
	t.Helper()
	return runCtx(t, prog, frame, forwarded)
}

// runCtx runs prog on frame with the skb context ctx, in the calling thread's namespace.
func runCtx(t testing.TB, prog *ebpf.Program, frame []byte, ctx skbContext) (uint32, []byte) {
	t.Helper()
	ret, out, err := runCtxErr(prog, frame, ctx)
	if err != nil {
		failRun(t, prog, err)
	}
	return ret, out
}

func runCtxErr(prog *ebpf.Program, frame []byte, ctx skbContext) (uint32, []byte, error) {
	opts := ebpf.RunOptions{Data: frame, DataOut: make([]byte, len(frame)+512), Repeat: 1, Context: ctx.forRun()}
	ret, err := prog.Run(&opts)
	return ret, opts.DataOut, err
}

// failRun stops a test whose program run failed: a kernel that cannot test-run tc programs is
// unavailable (see testutil.Unavailable), anything else a failure.
func failRun(t testing.TB, prog *ebpf.Program, err error) {
	t.Helper()
	if errors.Is(err, ebpf.ErrNotSupported) {
		testutil.Unavailable(t, "kernel cannot test-run tc programs: %v", err)
	}
	t.Fatalf("run %s: %v", prog, err)
}

// run runs prog once on frame, a forwarded packet, inside the harness's namespace.
func (h *harness) run(t testing.TB, prog *ebpf.Program, frame []byte) (uint32, []byte) {
	t.Helper()
	return h.runCtx(t, prog, frame, forwarded)
}

// runCtx is runCtx inside the harness's namespace.
func (h *harness) runCtx(t testing.TB, prog *ebpf.Program, frame []byte, ctx skbContext) (uint32, []byte) {
	t.Helper()
	var (
		ret uint32
		out []byte
		err error
	)
	if h.ns == nil { // a harness made by hand, around a datapath of its own
		h.ns = newNSRunner(t)
	}
	h.ns.do(func() { ret, out, err = runCtxErr(prog, frame, ctx) })
	if err != nil {
		failRun(t, prog, err)
	}
	return ret, out
}

func (h *harness) egress(frame []byte) (uint32, []byte) {
	h.t.Helper()
	return h.run(h.t, h.dp.Egress(), frame)
}

func (h *harness) ingress(frame []byte) (uint32, []byte) {
	h.t.Helper()
	return h.run(h.t, h.dp.Ingress(), frame)
}

// mustPass runs a program and requires TC_ACT_UNSPEC (the chain goes on) and valid checksums on
// the result.
func (h *harness) mustPass(prog *ebpf.Program, frame []byte) []byte {
	h.t.Helper()
	ret, out := h.run(h.t, prog, frame)
	if ret != tcNext {
		h.t.Fatalf("%s: verdict %d, want TC_ACT_UNSPEC (TCX_NEXT)", prog, int32(ret))
	}
	if err := verifyChecksums(out); err != nil {
		h.t.Fatalf("%s: output checksums: %v\n%s", prog, err, describe(out))
	}
	return out
}

func (h *harness) events() map[Event]uint64 {
	h.t.Helper()
	ev, err := h.dp.EventCounts()
	if err != nil {
		h.t.Fatal(err)
	}
	return ev
}

// Packets.

const (
	tcpSYN = 1 << iota
	tcpACK
	tcpFIN
	tcpRST
)

// Frames go from macA to macB, the address of the device test runs use (loopback: all zeros),
// so that the kernel marks them PACKET_HOST as a received frame for this host would be.
var (
	macA = net.HardwareAddr{2, 0, 0, 0, 0, 1}
	macB = net.HardwareAddr{0, 0, 0, 0, 0, 0}
)

// serialize builds an Ethernet frame around an IP packet of src -> dst carrying l4 layers.
func serialize(src, dst netip.Addr, proto layers.IPProtocol, l4 ...gopacket.SerializableLayer) []byte {
	eth := &layers.Ethernet{SrcMAC: macA, DstMAC: macB}
	var ip gopacket.NetworkLayer
	if src.Is4() {
		eth.EthernetType = layers.EthernetTypeIPv4
		ip = &layers.IPv4{Version: 4, IHL: 5, TTL: 64, Id: 0x1234, Protocol: proto,
			SrcIP: src.AsSlice(), DstIP: dst.AsSlice()}
	} else {
		eth.EthernetType = layers.EthernetTypeIPv6
		ip = &layers.IPv6{Version: 6, HopLimit: 64, NextHeader: proto, SrcIP: src.AsSlice(), DstIP: dst.AsSlice()}
	}
	for _, l := range l4 {
		if c, ok := l.(interface {
			SetNetworkLayerForChecksum(gopacket.NetworkLayer) error
		}); ok {
			if err := c.SetNetworkLayerForChecksum(ip); err != nil {
				panic(err)
			}
		}
	}
	buf := gopacket.NewSerializeBuffer()
	all := append([]gopacket.SerializableLayer{eth, ip.(gopacket.SerializableLayer)}, l4...)
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}, all...); err != nil {
		panic(err)
	}
	return append([]byte(nil), buf.Bytes()...)
}

// rawPacket is an IP packet of proto carrying data as it is.
func rawPacket(src, dst netip.Addr, proto layers.IPProtocol, data []byte) []byte {
	return serialize(src, dst, proto, gopacket.Payload(data))
}

// fillL4Checksum computes the checksum of a frame's L4 header (at the offset the parser finds),
// zero in the frame: one's complement with the pseudo-header at off in the header, or SCTP's
// CRC32c.
func fillL4Checksum(frame []byte, off int, sctp bool) []byte {
	p := parseFuzz(frame)
	l4 := frame[p.l4:p.end]
	if sctp {
		binary.LittleEndian.PutUint32(l4[off:], crc32.Checksum(l4, crc32.MakeTable(crc32.Castagnoli)))
		return frame
	}
	c := ^fold(sum16(l4, pseudoSum(p.src.AsSlice(), p.dst.AsSlice(), p.proto, len(l4))))
	if c == 0 {
		c = 0xffff
	}
	binary.BigEndian.PutUint16(l4[off:], c)
	return frame
}

// sctpPacket is an SCTP packet with a DATA chunk carrying data, its CRC32c valid.
func sctpPacket(src, dst netip.AddrPort, data []byte) []byte {
	h := binary.BigEndian.AppendUint16(nil, src.Port())
	h = binary.BigEndian.AppendUint16(h, dst.Port())
	h = append(h, 0xca, 0xfe, 0x01, 0x02, 0, 0, 0, 0) // verification tag, checksum
	n := 16 + len(data)
	h = append(h, 0, 3, byte(n>>8), byte(n), 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0) // DATA: TSN 1, stream 0
	h = append(h, data...)
	for len(h)%4 != 0 {
		h = append(h, 0)
	}
	return fillL4Checksum(rawPacket(src.Addr(), dst.Addr(), protoSCTP, h), 8, true)
}

// portsPacket is a UDP-Lite or DCCP packet (ports, then the checksum at 6, covering all of it).
func portsPacket(proto uint8, src, dst netip.AddrPort, data []byte) []byte {
	h := binary.BigEndian.AppendUint16(nil, src.Port())
	h = binary.BigEndian.AppendUint16(h, dst.Port())
	if proto == protoDCCP {
		// Data offset 4 (16 bytes), full coverage, checksum, a Data packet with a 48-bit sequence.
		h = append(h, 4, 0, 0, 0, 2<<1|1, 0, 0, 0, 0, 0, 0, 7)
	} else {
		h = append(h, 0, 0, 0, 0) // coverage 0: the whole packet
	}
	return fillL4Checksum(rawPacket(src.Addr(), dst.Addr(), layers.IPProtocol(proto), append(h, data...)), 6, false)
}

// icmpQuery is an ICMP or ICMPv6 query (or its reply) of type typ with identifier id.
func icmpQuery(src, dst netip.Addr, typ uint8, id uint16, data []byte) []byte {
	proto := layers.IPProtocolICMPv4
	if src.Is6() {
		proto = layers.IPProtocolICMPv6
	}
	m := []byte{typ, 0, 0, 0, byte(id >> 8), byte(id), 0, 7}
	f := rawPacket(src, dst, proto, append(m, data...))
	p := parseFuzz(f)
	l4 := f[p.l4:p.end]
	var s uint32
	if src.Is6() {
		s = pseudoSum(src.AsSlice(), dst.AsSlice(), uint8(proto), len(l4))
	}
	binary.BigEndian.PutUint16(l4[2:], ^fold(sum16(l4, s)))
	return f
}

// withExt6 puts IPv6 extension headers (hop-by-hop 0, routing 43 with no segments left,
// destination options 60) of 8 bytes each between the IPv6 header and the L4 header of a frame.
// The L4 checksum stays valid: its pseudo-header names the upper-layer protocol.
func withExt6(frame []byte, kinds ...uint8) []byte {
	next := frame[14+6]
	var ext []byte
	for i, k := range kinds {
		nh := next
		if i+1 < len(kinds) {
			nh = kinds[i+1]
		}
		if k == 43 {
			ext = append(ext, nh, 0, 4, 0, 0, 0, 0, 0) // type 4 (segment routing), no segments left
		} else {
			ext = append(ext, nh, 0, 1, 4, 0, 0, 0, 0) // a PadN option
		}
	}
	f := append(append(append([]byte(nil), frame[:14+40]...), ext...), frame[14+40:]...)
	f[14+6] = kinds[0]
	binary.BigEndian.PutUint16(f[14+4:], binary.BigEndian.Uint16(f[14+4:])+uint16(len(ext)))
	return f
}

// serializeRaw serializes layers as given (no IP layer added).
func serializeRaw(ls ...gopacket.SerializableLayer) []byte {
	buf := gopacket.NewSerializeBuffer()
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true}, ls...); err != nil {
		panic(err)
	}
	return append([]byte(nil), buf.Bytes()...)
}

func tcpPacket(src, dst netip.AddrPort, flags int, payload []byte) []byte {
	tcp := &layers.TCP{SrcPort: layers.TCPPort(src.Port()), DstPort: layers.TCPPort(dst.Port()),
		Seq: 1000, Window: 65535, SYN: flags&tcpSYN != 0, ACK: flags&tcpACK != 0,
		FIN: flags&tcpFIN != 0, RST: flags&tcpRST != 0}
	if tcp.ACK {
		tcp.Ack = 1000 // the other side's default Seq: nothing sent beyond it, so every FIN and RST lands in the window
	}
	return serialize(src.Addr(), dst.Addr(), layers.IPProtocolTCP, tcp, gopacket.Payload(payload))
}

func udpPacket(src, dst netip.AddrPort, payload []byte) []byte {
	udp := &layers.UDP{SrcPort: layers.UDPPort(src.Port()), DstPort: layers.UDPPort(dst.Port())}
	return serialize(src.Addr(), dst.Addr(), layers.IPProtocolUDP, udp, gopacket.Payload(payload))
}

// echoPacket is an ICMP or ICMPv6 echo request (or reply) with identifier id.
func echoPacket(src, dst netip.Addr, id uint16, request bool, payload []byte) []byte {
	if src.Is4() {
		typ := uint8(layers.ICMPv4TypeEchoReply)
		if request {
			typ = layers.ICMPv4TypeEchoRequest
		}
		icmp := &layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(typ, 0), Id: id, Seq: 7}
		return serialize(src, dst, layers.IPProtocolICMPv4, icmp, gopacket.Payload(payload))
	}
	typ := uint8(layers.ICMPv6TypeEchoReply)
	if request {
		typ = layers.ICMPv6TypeEchoRequest
	}
	icmp := &layers.ICMPv6{TypeCode: layers.CreateICMPv6TypeCode(typ, 0)}
	echo := &layers.ICMPv6Echo{Identifier: id, SeqNumber: 7}
	return serialize(src, dst, layers.IPProtocolICMPv6, icmp, echo, gopacket.Payload(payload))
}

// icmpErrorPacket is an ICMP error from src to dst quoting the IP packet of frame.
// rest is the 4 bytes after the checksum (unused, or the MTU of "fragmentation needed").
func icmpErrorPacket(src, dst netip.Addr, typ, code uint8, rest uint32, quoted []byte) []byte {
	payload := binary.BigEndian.AppendUint32(nil, rest)
	payload = append(payload, quoted[14:]...)
	if src.Is4() {
		icmp := &layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(typ, code),
			Id: uint16(rest >> 16), Seq: uint16(rest)}
		return serialize(src, dst, layers.IPProtocolICMPv4, icmp, gopacket.Payload(quoted[14:]))
	}
	icmp := &layers.ICMPv6{TypeCode: layers.CreateICMPv6TypeCode(typ, code)}
	return serialize(src, dst, layers.IPProtocolICMPv6, icmp, gopacket.Payload(payload))
}

// tuple is what a packet looks like to the NAT: protocol and both ends; for ICMP echo the
// identifier is the request's source port and the reply's destination port.
type tuple struct {
	proto    uint8
	src, dst netip.AddrPort
}

func (tu tuple) String() string { return fmt.Sprintf("%d %s -> %s", tu.proto, tu.src, tu.dst) }

func tupleOf(t testing.TB, frame []byte) tuple {
	t.Helper()
	// The fuzz model's parser: what bpf/parse.h reads, for every protocol.
	p := parseFuzz(frame)
	if p.kind == pktPass {
		t.Fatalf("not an IP packet the programs parse:\n%s", describe(frame))
	}
	return tuple{proto: p.proto, src: netip.AddrPortFrom(p.src, p.sport), dst: netip.AddrPortFrom(p.dst, p.dport)}
}

func describe(frame []byte) string {
	return gopacket.NewPacket(frame, layers.LayerTypeEthernet, gopacket.Default).Dump()
}

// Checksums, recomputed here from the bytes rather than trusted to any library.

func sum16(b []byte, s uint32) uint32 {
	for len(b) >= 2 {
		s += uint32(b[0])<<8 | uint32(b[1])
		b = b[2:]
	}
	if len(b) == 1 {
		s += uint32(b[0]) << 8
	}
	return s
}

// valid tells whether a one's complement sum including the checksum field folds to 0xffff.
func valid(s uint32) bool {
	for s > 0xffff {
		s = s&0xffff + s>>16
	}
	return s == 0xffff
}

func pseudoSum(src, dst []byte, proto uint8, length int) uint32 {
	s := sum16(src, 0)
	s = sum16(dst, s)
	return s + uint32(proto) + uint32(length)
}

// verifyChecksums checks the IPv4 header checksum and the L4 checksum of an Ethernet frame
// (skipped for fragments, whose datagram checksum needs reassembly: see verifyDatagram). For
// ICMP errors it also checks the quoted IPv4 header and, when the quote is complete, the quoted
// L4 checksum.
func verifyChecksums(frame []byte) error {
	if len(frame) < 14 {
		return fmt.Errorf("frame of %d bytes", len(frame))
	}
	switch binary.BigEndian.Uint16(frame[12:]) {
	case uint16(layers.EthernetTypeIPv4), uint16(layers.EthernetTypeIPv6):
		return verifyIP(frame[14:], true)
	}
	return nil
}

func verifyIP(pkt []byte, outer bool) error {
	if len(pkt) < 1 {
		return errors.New("empty IP packet")
	}
	var src, dst, l4 []byte
	var proto uint8
	complete := true
	switch pkt[0] >> 4 {
	case 4:
		ihl := int(pkt[0]&0xf) * 4
		if len(pkt) < ihl {
			return fmt.Errorf("truncated IPv4 header")
		}
		if !valid(sum16(pkt[:ihl], 0)) {
			return fmt.Errorf("bad IPv4 header checksum %#04x", binary.BigEndian.Uint16(pkt[10:]))
		}
		total := int(binary.BigEndian.Uint16(pkt[2:]))
		if frag := binary.BigEndian.Uint16(pkt[6:]); frag&0x3fff != 0 {
			return nil // fragment: verifyDatagram checks the reassembled datagram
		}
		if total > len(pkt) {
			if outer {
				return fmt.Errorf("IPv4 total length %d beyond %d bytes", total, len(pkt))
			}
			complete, total = false, len(pkt)
		}
		src, dst, proto, l4 = pkt[12:16], pkt[16:20], pkt[9], pkt[ihl:total]
	case 6:
		if len(pkt) < 40 {
			return fmt.Errorf("truncated IPv6 header")
		}
		total := 40 + int(binary.BigEndian.Uint16(pkt[4:]))
		if total > len(pkt) {
			if outer {
				return fmt.Errorf("IPv6 payload length beyond the packet")
			}
			complete, total = false, len(pkt)
		}
		src, dst, proto = pkt[8:24], pkt[24:40], pkt[6]
		// Extension headers (hop-by-hop, routing, destination options, AH); a fragment's
		// datagram checksum needs reassembly (see verifyDatagram).
		off := 40
		for slices.Contains([]uint8{0, 43, 60, 51}, proto) && off+8 <= total {
			n := (int(pkt[off+1]) + 1) * 8
			if proto == 51 {
				n = (int(pkt[off+1]) + 2) * 4
			}
			proto, off = pkt[off], off+n
		}
		if proto == 44 || off > total {
			return nil
		}
		l4 = pkt[off:total]
	default:
		return fmt.Errorf("IP version %d", pkt[0]>>4)
	}
	v6 := pkt[0]>>4 == 6
	if !complete {
		return nil // a quote cut short: its L4 checksum covers bytes that are not there
	}
	switch proto {
	case uint8(layers.IPProtocolTCP):
		if len(l4) < 20 || !valid(sum16(l4, pseudoSum(src, dst, proto, len(l4)))) {
			return fmt.Errorf("bad TCP checksum")
		}
	case protoUDPLite, protoDCCP: // full coverage in the tests' packets
		if len(l4) < 8 || !valid(sum16(l4, pseudoSum(src, dst, proto, len(l4)))) {
			return fmt.Errorf("bad checksum of protocol %d", proto)
		}
	case protoSCTP:
		if len(l4) < 12 {
			return fmt.Errorf("truncated SCTP header")
		}
		if r := crc32cResidual(l4); r != 0 {
			return fmt.Errorf("bad SCTP CRC32c %#08x", binary.LittleEndian.Uint32(l4[8:]))
		}
	case uint8(layers.IPProtocolUDP):
		if len(l4) < 8 {
			return fmt.Errorf("truncated UDP header")
		}
		if binary.BigEndian.Uint16(l4[6:]) == 0 && !v6 {
			return nil
		}
		if !valid(sum16(l4, pseudoSum(src, dst, proto, len(l4)))) {
			return fmt.Errorf("bad UDP checksum %#04x", binary.BigEndian.Uint16(l4[6:]))
		}
	case uint8(layers.IPProtocolICMPv4):
		if len(l4) < 8 || !valid(sum16(l4, 0)) {
			return fmt.Errorf("bad ICMP checksum")
		}
		if outer && (l4[0] == 3 || l4[0] == 11) {
			if err := verifyIP(l4[8:], false); err != nil {
				return fmt.Errorf("quoted packet: %w", err)
			}
		}
	case uint8(layers.IPProtocolICMPv6):
		if len(l4) < 8 || !valid(sum16(l4, pseudoSum(src, dst, proto, len(l4)))) {
			return fmt.Errorf("bad ICMPv6 checksum")
		}
		if outer && l4[0] < 128 {
			if err := verifyIP(l4[8:], false); err != nil {
				return fmt.Errorf("quoted packet: %w", err)
			}
		}
	}
	return nil
}

// Addresses for tests: pods in 10.0.0.0/8 (never masqueraded as destinations by default),
// remotes outside every default non-masquerade range.
func pod4(i int) netip.Addr { return netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}) }
func pod6(i int) netip.Addr {
	return netip.AddrFrom16([16]byte{0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, byte(i >> 8), byte(i)})
}

var (
	remote4 = netip.MustParseAddr("198.51.100.7")
	remote6 = netip.MustParseAddr("2001:db8:ffff::7")
)

func pod(v6 bool, i int) netip.Addr {
	if v6 {
		return pod6(i)
	}
	return pod4(i)
}

func remote(v6 bool) netip.Addr {
	if v6 {
		return remote6
	}
	return remote4
}

func ap(a netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(a, port) }

// partnerKey is the key (src, dst) of the other half of e's flow, and pointsBack tells whether
// p, found there, is that half: the datapath's own natTuple.partner and pointedBy, on decoded
// entries (only To of the value matters to either).
func partnerKey(e NATEntry) (src, dst netip.AddrPort) {
	p := keyTuple(e.Dir, e.Proto, e.Src, e.Dst).partner(translation(e))
	pe := p.decode(&masqNatEntry{})
	return pe.Src, pe.Dst
}

func pointsBack(e, p NATEntry) bool {
	return keyTuple(e.Dir, e.Proto, e.Src, e.Dst).pointedBy(translation(p))
}

func translation(e NATEntry) *masqNatEntry {
	return &masqNatEntry{Addr: addrBytes(e.To.Addr()), Port: htons(e.To.Port())}
}

// lpmKey is the trie key of a prefix, of its family's layout.
func lpmKey(p netip.Prefix) any {
	if p.Addr().Is4() {
		return masqLpm4Key{}.withPrefix(p)
	}
	return masqLpm6Key{}.withPrefix(p)
}

// isDrop tells whether an event counts dropped packets.
func isDrop(e Event) bool {
	_, ok := e.DropReason()
	return ok
}
