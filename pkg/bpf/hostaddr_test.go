package bpf

import (
	"bytes"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// Host sockets on node addresses other than the uplink's: their traffic is the host's, as the
// uplink address's is (bpf/scope.h).

// addNodeAddress gives the scope env's node another address, on lo.
func (e *scopeEnv) addNodeAddress(t *testing.T, a netip.Addr) {
	t.Helper()
	testutil.InNetns(t, e.ns, func() {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			t.Fatal(err)
		}
		addr := &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(a.BitLen(), a.BitLen())}}
		if a.Is6() {
			addr.Flags = unix.IFA_F_NODAD
		}
		if err := netlink.AddrAdd(lo, addr); err != nil {
			t.Fatal(err)
		}
		// An IPv6 address's local route comes a moment after the address (the kernel's address
		// work queue), and the programs ask the routes.
		if err := testutil.Poll(2*time.Second, 10*time.Millisecond, func() error {
			if rs, err := netlink.RouteGet(a.AsSlice()); err != nil || len(rs) == 0 || rs[0].Type != unix.RTN_LOCAL {
				return testutil.NotYet("%s a local address: %v %v", a, rs, err)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	})
}

// TestHostTrafficOnNodeAddresses: what a host socket on a node address other than the uplink's
// sends is host traffic, whatever the datapath saw of its flow (its requests may come by another
// device, or before the programs ran): a SYN-ACK leaves, and a UDP answer keeps its source, on a
// second address and on one added while the programs run. Its flows are recorded only on ports
// of the NAT range (where they reserve their port), as the uplink address's are.
func TestHostTrafficOnNodeAddresses(t *testing.T) {
	e := newScopeEnv(t)
	vip4, vip6 := netip.MustParseAddr("10.77.9.9"), netip.MustParseAddr("fd77::9:9")
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			e.t = t
			other, vip := nodeOther4, vip4
			if fam.v6 {
				other, vip = nodeOther6, vip6
			}
			e.addNodeAddress(t, vip)
			client := ap(remote(fam.v6), 40000)
			for _, a := range []netip.Addr{other, vip} {
				before := e.entries(t)
				for _, c := range []struct {
					name  string
					frame []byte
				}{
					{"SYN-ACK", tcpSegment(ap(a, 7778), client, seg{flags: tcpSYN | tcpACK, seq: 900, ack: 101, win: 65160, wscale: 7})},
					{"data", tcpPacket(ap(a, 7778), client, tcpACK, payload)},
					{"UDP answer", udpPacket(ap(a, 53), client, payload)},
				} {
					in := withMACs(c.frame, uplinkMAC, childMAC)
					ret, out := e.run(t, e.dp.Egress(), in, 0)
					if ret != tcNext || !bytes.Equal(out[:len(in)], in) {
						t.Errorf("%s from %s: verdict %d, changed %v, want it passed untouched", c.name, a, int32(ret),
							!bytes.Equal(out[:len(in)], in))
					}
				}
				if n := e.entries(t) - before; n != 0 {
					t.Errorf("host traffic from %s on ports outside the NAT range made %d entries", a, n)
				}
				in := withMACs(udpPacket(ap(a, 40123), ap(remote(fam.v6), 53), payload), uplinkMAC, childMAC)
				if ret, out := e.run(t, e.dp.Egress(), in, 0); ret != tcNext || !bytes.Equal(out[:len(in)], in) {
					t.Errorf("a host flow from %s on a port of the range: verdict %d, changed %v", a, int32(ret), !bytes.Equal(out[:len(in)], in))
				}
				if en, ok := e.entry(Egress, unix.IPPROTO_UDP, ap(a, 40123), ap(remote(fam.v6), 53)); !ok || en.Kind != KindHost {
					t.Errorf("a host flow from %s on a port of the range is not recorded as one: %+v (found %v)", a, en, ok)
				}
			}
		})
	}
}
