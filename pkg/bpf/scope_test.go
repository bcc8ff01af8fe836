package bpf

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// The scope tests run the programs as the uplink of a namespace of their own: BPF_PROG_TEST_RUN
// gives the packet the device of the context (a veth there, with its MAC and the uplink
// addresses), and the programs' FIB lookups see that namespace's addresses.

var (
	uplinkMAC = net.HardwareAddr{2, 0, 0, 0, 0, 0xa}
	// failedOver is the uplink's MAC after a bond failed over (fail_over_mac=active: its new
	// active slave's), before the agent followed it into uplink_macs.
	failedOver = net.HardwareAddr{2, 0, 0, 0, 0, 0xb}
	childMAC   = net.HardwareAddr{2, 0, 0, 0, 0, 0xc} // a macvlan child's
	// nodeOther4 and nodeOther6 are addresses of the node that are not the uplink's (on lo).
	nodeOther4 = netip.MustParseAddr("10.77.0.1")
	nodeOther6 = netip.MustParseAddr("fd77::1")
	// stranger4 and stranger6 are on the uplink's subnets but not the node's: an ipvlan child's.
	stranger4 = netip.MustParseAddr("192.0.2.50")
	stranger6 = netip.MustParseAddr("2001:db8::50")
)

type scopeEnv struct {
	*harness
	ns     string
	uplink int // ifindex of the namespace's uplink
	pods   int // ifindex of the device the pod networks are routed by
}

// newScopeEnv builds the namespace (uplink veth "up0" with uplinkMAC and the SNAT addresses,
// the node's other addresses on lo, the pod networks routed by "pods", forwarding on) and a
// harness whose uplink is up0.
func newScopeEnv(t *testing.T) *scopeEnv {
	t.Helper()
	testutil.RequirePrivileged(t, "ip")
	ns := testutil.NewNetns(t)
	batch := fmt.Sprintf(`link set lo up
addr add %s/32 dev lo
addr add %s/128 dev lo
link add up0 address %s type veth peer name up1
addr add %s/24 dev up0
addr add %s/64 dev up0 nodad
link set up0 up
link set up1 up
route add default via 192.0.2.254 dev up0
route add default via 2001:db8::fe dev up0
link add pods type veth peer name pods1
link set pods up
link set pods1 up
route add 10.1.0.0/16 dev pods
route add fd00::/16 dev pods
`, nodeOther4, nodeOther6, uplinkMAC, snat4, snat6)
	if err := testutil.IPBatch(context.Background(), ns, batch); err != nil {
		t.Fatal(err)
	}
	env := &scopeEnv{harness: newHarness(t, defaultPolicy(false), LoadOptions{}), ns: ns}
	testutil.InNetns(t, ns, func() {
		for _, key := range []string{"net/ipv4/conf/all/forwarding", "net/ipv6/conf/all/forwarding"} {
			if err := os.WriteFile(filepath.Join("/proc/sys", key), []byte("1"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		for dev, idx := range map[string]*int{"up0": &env.uplink, "pods": &env.pods} {
			ifc, err := net.InterfaceByName(dev)
			if err != nil {
				t.Fatal(err)
			}
			*idx = ifc.Index
		}
	})
	if _, err := env.dp.SetUplink(env.uplink, Uplink{IPv4: snat4, IPv6: snat6, MAC: MACOf(uplinkMAC)}); err != nil {
		t.Fatal(err)
	}
	return env
}

// run runs prog on the namespace's uplink; ingressIfindex is 0 for a packet the node sent, a
// device for one it forwarded.
func (e *scopeEnv) run(t *testing.T, prog *ebpf.Program, frame []byte, ingressIfindex uint32) (uint32, []byte) {
	t.Helper()
	var ret uint32
	var out []byte
	testutil.InNetns(t, e.ns, func() {
		ret, out = runCtx(t, prog, frame, skbContext{Ifindex: uint32(e.uplink), IngressIfindex: ingressIfindex})
	})
	return ret, out
}

// withMACs sets a frame's source and destination MAC.
func withMACs(frame []byte, src, dst net.HardwareAddr) []byte {
	f := append([]byte(nil), frame...)
	copy(f[0:6], dst)
	copy(f[6:12], src)
	return f
}

func (e *scopeEnv) entries(t *testing.T) int {
	t.Helper()
	n := 0
	for _, fam := range policy.Families() {
		if err := e.dp.NATEntries(fam, func(NATEntry) bool { n++; return true }); err != nil {
			t.Fatal(err)
		}
	}
	return n
}

// TestScope: only what the node's IP stack forwarded or sent from one of its own addresses is
// masqueraded; a macvlan child's frame (another source MAC), an ipvlan child's and a packet
// socket's (the uplink's MAC, nothing received, a source the node does not own) pass untouched
// and open no flow; ingress translates only frames addressed to the uplink. While the uplink's
// MAC changed under uplink_macs (a bond failing over), what the node forwarded from its pods,
// whose source routes back by the device it came in on, is still masqueraded.
func TestScope(t *testing.T) {
	e := newScopeEnv(t)
	remoteEnd := func(v6 bool) netip.AddrPort { return ap(remote(v6), 53) }
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			e.t = t
			nodeOther, stranger := nodeOther4, stranger4
			if fam.v6 {
				nodeOther, stranger = nodeOther6, stranger6
			}
			uplinkAddr := snatFor(pod(fam.v6, 1))
			for i, c := range []struct {
				name string
				src  netip.Addr
				mac  net.HardwareAddr
				iif  uint32
				// masq: leaves with the uplink address; else untouched.
				masq    bool
				entries int
			}{
				{"forwarded pod packet", pod(fam.v6, 1), uplinkMAC, podDevice, true, 2},
				// Host traffic, as from the uplink address (TestHostTrafficOnNodeAddresses).
				{"node packet from another of its addresses", nodeOther, uplinkMAC, 0, false, 0},
				// A host port outside the NAT range: no pod mapping can collide, nothing is recorded.
				{"node packet from the uplink address (host flow)", uplinkAddr, uplinkMAC, 0, false, 0},
				{"macvlan child", stranger, childMAC, 0, false, 0},
				{"macvlan child that routes (received in its namespace)", pod(fam.v6, 2), childMAC, 7, false, 0},
				{"macvlan child that routes, received by a device numbered as the uplink", pod(fam.v6, 2), childMAC, uint32(e.uplink), false, 0},
				{"forwarded pod packet, the uplink's MAC changed (bond failover)", pod(fam.v6, 3), failedOver, uint32(e.pods), true, 2},
				{"ipvlan child (l2 mode)", stranger, uplinkMAC, 0, false, 0},
			} {
				before := e.entries(t)
				in := withMACs(udpPacket(ap(c.src, 5400+uint16(i)), remoteEnd(fam.v6), payload), c.mac, net.HardwareAddr{2, 0, 0, 0, 0, 0xe})
				ret, out := e.run(t, e.dp.Egress(), in, c.iif)
				if ret != tcNext {
					t.Fatalf("%s: verdict %d", c.name, int32(ret))
				}
				out = out[:len(in)]
				if got := tupleOf(t, out).src.Addr(); c.masq && got != uplinkAddr {
					t.Errorf("%s: left as %s, want masqueraded to %s", c.name, got, uplinkAddr)
				}
				if !c.masq && !bytes.Equal(out, in) {
					t.Errorf("%s: changed to %s", c.name, tupleOf(t, out))
				}
				if n := e.entries(t) - before; n != c.entries {
					t.Errorf("%s: %d new NAT entries, want %d", c.name, n, c.entries)
				}
			}

			// The reply to the forwarded pod's flow: translated only when addressed to the uplink.
			out := e.mustRun(t, withMACs(udpPacket(ap(pod(fam.v6, 1), 5353), remoteEnd(fam.v6), payload), uplinkMAC, childMAC))
			mapped := tupleOf(t, out).src
			reply := udpPacket(remoteEnd(fam.v6), mapped, payload)
			for _, c := range []struct {
				name string
				dst  net.HardwareAddr
				want netip.AddrPort
			}{
				{"to a macvlan child's MAC", childMAC, mapped},
				{"broadcast", net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, mapped},
				{"to the uplink", uplinkMAC, ap(pod(fam.v6, 1), 5353)},
			} {
				ret, back := e.run(t, e.dp.Ingress(), withMACs(reply, net.HardwareAddr{2, 0, 0, 0, 0, 0xe}, c.dst), 0)
				if ret != tcNext {
					t.Fatalf("reply %s: verdict %d", c.name, int32(ret))
				}
				if got := tupleOf(t, back[:len(reply)]).dst; got != c.want {
					t.Errorf("reply %s arrives for %s, want %s", c.name, got, c.want)
				}
			}
		})
	}
	// A DHCP client's discover, sent by a packet socket on the uplink from 0.0.0.0 to the
	// broadcast address (which the default policy masquerades).
	e.t = t
	before := e.entries(t)
	dhcp := withMACs(udpPacket(ap(netip.IPv4Unspecified(), 68), ap(netip.AddrFrom4([4]byte{255, 255, 255, 255}), 67), payload),
		uplinkMAC, net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	if ret, out := e.run(t, e.dp.Egress(), dhcp, 0); ret != tcNext || !bytes.Equal(out[:len(dhcp)], dhcp) {
		t.Errorf("DHCP discover: verdict %d, changed %v", int32(ret), !bytes.Equal(out[:len(dhcp)], dhcp))
	}
	if n := e.entries(t) - before; n != 0 {
		t.Errorf("DHCP discover: %d NAT entries", n)
	}
}

// mustRun runs egress on a forwarded frame and requires the chain to go on.
func (e *scopeEnv) mustRun(t *testing.T, frame []byte) []byte {
	t.Helper()
	ret, out := e.run(t, e.dp.Egress(), frame, podDevice)
	if ret != tcNext {
		t.Fatalf("verdict %d", int32(ret))
	}
	return out[:len(frame)]
}

// vlanPusher is a program that gives the packet a VLAN tag the way a VLAN sub-interface's frame
// carries it to its parent (beside the frame, skb->vlan_tci: bpf_skb_vlan_push), then runs
// target (a tail call) and returns its verdict.
func vlanPusher(t *testing.T, target *ebpf.Program) *ebpf.Program {
	t.Helper()
	progs, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.ProgramArray, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { progs.Close() })
	if err := progs.Put(uint32(0), target); err != nil {
		t.Fatal(err)
	}
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "vlan_push", Type: ebpf.SchedCLS, License: "GPL",
		Instructions: asm.Instructions{
			asm.Mov.Reg(asm.R6, asm.R1),
			asm.Mov.Imm(asm.R2, 0x0081), // ETH_P_8021Q, network byte order
			asm.Mov.Imm(asm.R3, 100),    // the VLAN id
			asm.FnSkbVlanPush.Call(),
			asm.Mov.Reg(asm.R1, asm.R6),
			asm.LoadMapPtr(asm.R2, progs.FD()),
			asm.Mov.Imm(asm.R3, 0),
			asm.FnTailCall.Call(),
			asm.Mov.Imm(asm.R0, 99), // the tail call failed
			asm.Return(),
		}})
	if err != nil {
		t.Fatalf("load the VLAN pusher: %v", err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// TestScopeVLAN: a frame with a VLAN tag beside it (a VLAN sub-interface's, on its parent) passes
// both programs untouched and opens no flow, even a reply to a flow of ours; a frame with the tag
// in it is not IP to the programs and passes too.
func TestScopeVLAN(t *testing.T) {
	e := newScopeEnv(t)
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			e.t = t
			out := e.mustRun(t, withMACs(udpPacket(ap(pod(fam.v6, 3), 4000), ap(remote(fam.v6), 53), payload), uplinkMAC, childMAC))
			reply := withMACs(udpPacket(ap(remote(fam.v6), 53), tupleOf(t, out).src, payload), childMAC, uplinkMAC)
			before := e.entries(t)
			for _, c := range []struct {
				name  string
				prog  *ebpf.Program
				frame []byte
				iif   uint32
			}{
				{"egress, new flow", e.dp.Egress(), withMACs(udpPacket(ap(pod(fam.v6, 4), 4000), ap(remote(fam.v6), 53), payload), uplinkMAC, childMAC), podDevice},
				{"ingress, reply to a flow of ours", e.dp.Ingress(), reply, 0},
			} {
				ret, got := e.run(t, vlanPusher(t, c.prog), c.frame, c.iif)
				if ret != tcNext || !bytes.Equal(got[:len(c.frame)], c.frame) {
					t.Errorf("%s: verdict %d, changed %v\n%s", c.name, int32(ret), !bytes.Equal(got[:len(c.frame)], c.frame),
						describe(got[:len(c.frame)]))
				}
				// In the frame: ETH_P_8021Q, then the IP packet.
				tagged := serializeRaw(&layers.Ethernet{SrcMAC: uplinkMAC, DstMAC: childMAC, EthernetType: layers.EthernetTypeDot1Q},
					&layers.Dot1Q{VLANIdentifier: 100, Type: layers.EthernetType(uint16(c.frame[12])<<8 | uint16(c.frame[13]))},
					gopacket.Payload(c.frame[14:]))
				if ret, got := e.run(t, c.prog, tagged, c.iif); ret != tcNext || !bytes.Equal(got[:len(tagged)], tagged) {
					t.Errorf("%s, tag in the frame: verdict %d, changed", c.name, int32(ret))
				}
			}
			if n := e.entries(t) - before; n != 0 {
				t.Errorf("%d NAT entries from tagged frames", n)
			}
		})
	}
}
