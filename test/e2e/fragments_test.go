package e2e

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Fragments in any order of arrival, as a multipath network delivers them: conntrack reassembles
// a datagram whatever the order of its fragments, before it translates it.

// fragPort is where the external host's test sockets take fragmented datagrams.
const fragPort = 7791

// fragPayload is the payload of a datagram that three fragments carry at the topology's MTU.
var fragPayload = bytes.Repeat([]byte("0123456789abcdef"), 200) // 3,200 bytes

// fragAttempts is how many datagrams a check sends before it fails: an attempt may meet a
// neighbour entry being resolved, which holds only a few packets.
const fragAttempts = 3

// listenUDP opens a UDP socket on local in ns; it is closed when the test ends.
func listenUDP(t testing.TB, ns string, local netip.AddrPort) *net.UDPConn {
	t.Helper()
	var c *net.UDPConn
	if err := testutil.Do(ns, func() error {
		var err error
		c, err = net.ListenUDP("udp", net.UDPAddrFromAddrPort(local))
		return err
	}); err != nil {
		t.Fatalf("udp socket on %s in %s: %v", local, ns, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// readDatagram reads one datagram within d.
func readDatagram(c *net.UDPConn, d time.Duration) ([]byte, netip.AddrPort, error) {
	if err := c.SetReadDeadline(time.Now().Add(d)); err != nil {
		return nil, netip.AddrPort{}, err
	}
	buf := make([]byte, 65536)
	n, from, err := c.ReadFromUDPAddrPort(buf)
	return buf[:n], netip.AddrPortFrom(from.Addr().Unmap(), from.Port()), err
}

// fragmentsOut sends, from the pod, datagrams to the external host in three fragments, the
// last first, until one arrives whole (or fragAttempts fail): it must come from the node's
// address.
func fragmentsOut(t testing.TB, env *Env, fam policy.Family, dst netip.Addr, attempt int) error {
	sock := listenUDP(t, env.Ext, netip.AddrPortFrom(dst, fragPort))
	pod := OpenLink(t, env.Pod, "eth0", env.Node, "pod0")
	var err error
	for i := range fragAttempts {
		src := netip.AddrPortFrom(PodAddr(fam), uint16(5400+10*attempt+i))
		frames := pod.UDPFragments(src, netip.AddrPortFrom(dst, fragPort), fragPayload, uint32(0x4100+16*attempt+i), 3)
		if err = pod.Send(Reversed(frames)...); err != nil {
			return err
		}
		var got []byte
		var from netip.AddrPort
		if got, from, err = readDatagram(sock, time.Second); err != nil {
			continue
		}
		if !bytes.Equal(got, fragPayload) {
			return fmt.Errorf("a datagram of %d bytes arrived, not the %d sent", len(got), len(fragPayload))
		}
		if from.Addr() != NodeAddr(fam) {
			return fmt.Errorf("the datagram arrived from %s, want the node's address", from)
		}
		return nil
	}
	return fmt.Errorf("no datagram sent last fragment first from %s arrived whole: %w", PodAddr(fam), err)
}

// fragmentsIn opens a flow from the pod to the external host, which answers with datagrams in
// three fragments, the last first, until one arrives whole at the pod (or fragAttempts fail).
func fragmentsIn(t testing.TB, env *Env, fam policy.Family, remote netip.Addr, attempt int) error {
	server := listenUDP(t, env.Ext, netip.AddrPortFrom(remote, fragPort+1))
	local := netip.AddrPortFrom(PodAddr(fam), uint16(5500+attempt))
	client := listenUDP(t, env.Pod, local)
	ext := OpenLink(t, env.Ext, "eth0", env.Node, Uplink)
	var err error
	for i := range fragAttempts {
		if _, err = client.WriteToUDPAddrPort([]byte("query"), netip.AddrPortFrom(remote, fragPort+1)); err != nil {
			return err
		}
		var seen netip.AddrPort
		if _, seen, err = readDatagram(server, time.Second); err != nil {
			continue
		}
		frames := ext.UDPFragments(netip.AddrPortFrom(remote, fragPort+1), seen, fragPayload, uint32(0x5100+16*attempt+i), 3)
		if err = ext.Send(Reversed(frames)...); err != nil {
			return err
		}
		var got []byte
		if got, _, err = readDatagram(client, time.Second); err != nil {
			continue
		}
		if !bytes.Equal(got, fragPayload) {
			return fmt.Errorf("an answer of %d bytes arrived, not the %d sent", len(got), len(fragPayload))
		}
		return nil
	}
	return fmt.Errorf("no answer to %s sent last fragment first arrived whole: %w", local, err)
}

// TestFragmentsLastFirst: a datagram in three fragments sent last first arrives whole, from the
// pod to the external host (from the node's address) and back, IPv4 and IPv6, on a node with no
// other rules and on one with kube-proxy's (whose conntrack reassembles datagrams in PREROUTING,
// after tc ingress); no packet ever leaves the node with the pod's address.
func TestFragmentsLastFirst(t *testing.T) {
	for _, b := range backends() {
		for _, rules := range []ProxyMode{"", ProxyIptables, ProxyNftables} {
			name := "bare"
			if rules != "" {
				name = "kube-proxy-" + string(rules)
			}
			t.Run(b.Name+"/"+name, func(t *testing.T) {
				t.Parallel()
				requireBackend(t, b)
				ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
				defer cancel()
				env := NewBackendEnv(ctx, t, b, []string{"--enable-ipv6"})
				if rules != "" {
					InstallServices(ctx, t, env, rules, b.Iptables, testServices())
				}
				env.StartReady(ctx, t, b, keepLocalConfig)
				leaks := StartSniffer(t, env.Ext, "eth0", PodAddr4, PodAddr6)
				var failed []string
				for i, dst := range []netip.Addr{public4, public6} {
					fam := policy.FamilyOf(dst)
					// Neighbours resolved on every hop first, so that fragments meet no queue.
					if _, err := env.Probe(ctx, "udp", dst); err != nil {
						t.Fatal(err)
					}
					if err := fragmentsOut(t, env, fam, dst, i); err != nil {
						failed = append(failed, fmt.Sprintf("%s out: %v", fam, err))
					}
					if err := fragmentsIn(t, env, fam, dst, i); err != nil {
						failed = append(failed, fmt.Sprintf("%s in: %v", fam, err))
					}
				}
				if n := leaks.Stop(); n > 0 {
					failed = append(failed, fmt.Sprintf("%d packets left the node with the pod's address", n))
				}
				if len(failed) > 0 {
					t.Errorf("fragments sent last first:\n%s", strings.Join(failed, "\n"))
				}
			})
		}
	}
}
