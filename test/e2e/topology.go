package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Addresses of the topology. The node's uplink addresses are what a masqueraded flow shows; the
// pod's are what a flow that keeps its identity shows. Both lie outside every destination.
var (
	PodAddr4  = netip.MustParseAddr("10.244.1.2")
	PodGW4    = netip.MustParseAddr("10.244.1.1")
	PodAddr6  = netip.MustParseAddr("fd00:10:244:1::2")
	PodGW6    = netip.MustParseAddr("fd00:10:244:1::1")
	NodeAddr4 = netip.MustParseAddr("10.99.0.1")
	ExtAddr4  = netip.MustParseAddr("10.99.0.2")
	NodeAddr6 = netip.MustParseAddr("2001:db8:99::1")
	ExtAddr6  = netip.MustParseAddr("2001:db8:99::2")
	// NodeAlt4 and NodeAlt6 are the uplink's second addresses (AddAltAddresses), which
	// masquerade addresses choose: an IPv4 secondary, and an IPv6 address made deprecated so
	// that the kernel never picks it as a source of its own (MASQUERADE, the node's sockets).
	NodeAlt4 = netip.MustParseAddr("10.99.0.11")
	NodeAlt6 = netip.MustParseAddr("2001:db8:99::11")
	PodNet4  = netip.MustParsePrefix("10.244.0.0/16")
	PodNet6  = netip.MustParsePrefix("fd00:10:244::/48")
)

// probeWindow bounds one probe; a probe that gets no answer in it failed.
const probeWindow = 2 * time.Second

// EchoPort is where the external host's echo servers listen, TCP and UDP.
const EchoPort = 7777

// Uplink is the node's device toward the external host (the device of its default routes).
const Uplink = "uplink"

// Destinations are the addresses the external host owns: one or more per range the scenarios
// distinguish. Every topology has all of them.
func Destinations() []netip.Addr {
	var out []netip.Addr
	for _, s := range []string{
		"8.8.8.8",         // public
		"10.1.2.3",        // RFC 1918 10/8
		"10.10.10.10",     // the seed's service VIP (masqueradeCIDRs inside 10/8)
		"172.16.5.5",      // RFC 1918 172.16/12
		"192.168.1.1",     // RFC 1918 192.168/16
		"169.254.169.254", // link-local
		"100.64.230.5",    // the seeds' 100.64.230.0/24
		"100.64.1.1",      // RFC 6598 shared space, outside 100.64.230.0/24
		"192.0.2.1",       // TEST-NET-1
		"198.18.0.1",      // benchmarking
		"198.51.100.1",    // TEST-NET-2
		"203.0.113.1",     // TEST-NET-3
		"240.0.0.1",       // former class E
		"2001:4860:4860::8888",
		"2001:db8::1",
		"fd00::1",
		"fc00::1",
	} {
		out = append(out, netip.MustParseAddr(s))
	}
	return out
}

// Topology is three namespaces: pod -> node -> external host.
type Topology struct {
	Pod, Node, Ext string
	// nextPort hands out pod source ports: each probe is a new 5-tuple, so no conntrack entry
	// of an earlier probe (made under an earlier policy) can decide a later one.
	nextPort atomic.Uint32
}

// NewTopology builds the namespaces and links, starts the echo servers on the external host and
// registers their removal with t.Cleanup.
func NewTopology(ctx context.Context, t testing.TB) *Topology {
	t.Helper()
	tp := &Topology{Pod: testutil.NewNetns(t), Node: testutil.NewNetns(t), Ext: testutil.NewNetns(t)}
	tp.nextPort.Store(10000)
	if err := tp.build(ctx); err != nil {
		t.Fatalf("build topology: %v", err)
	}
	stop, err := StartEcho(tp.Ext, Destinations(), EchoPort)
	if err != nil {
		t.Fatalf("echo servers: %v", err)
	}
	t.Cleanup(stop)
	return tp
}

func (tp *Topology) build(ctx context.Context) error {
	// Without duplicate address detection, link-local addresses are usable at once, so neighbour
	// discovery works from the first packet instead of after a second or two.
	for _, ns := range []string{tp.Pod, tp.Node, tp.Ext} {
		for _, key := range []string{"net.ipv6.conf.all.accept_dad", "net.ipv6.conf.default.accept_dad"} {
			if err := WriteSysctl(ns, key, "0"); err != nil {
				return err
			}
		}
	}
	var ext strings.Builder
	ext.WriteString("link set lo up\n")
	for _, d := range Destinations() {
		bits := 32
		extra := ""
		if d.Is6() {
			bits, extra = 128, " nodad"
		}
		fmt.Fprintf(&ext, "addr add %s/%d dev lo%s\n", d, bits, extra)
	}
	// The veths are created from the node's side, so nothing ever appears in the host namespace.
	node := fmt.Sprintf(`link set lo up
link add pod0 type veth peer name eth0 netns %s
link add %s type veth peer name eth0 netns %s
addr add %s/24 dev pod0
addr add %s/64 dev pod0 nodad
addr add %s/24 dev %s
addr add %s/64 dev %s nodad
link set pod0 up
link set %s up
route add default via %s dev %s
route add default via %s dev %s
`, tp.Pod, Uplink, tp.Ext, PodGW4, PodGW6, NodeAddr4, Uplink, NodeAddr6, Uplink, Uplink, ExtAddr4, Uplink, ExtAddr6, Uplink)
	if err := testutil.IPBatch(ctx, tp.Node, node); err != nil {
		return err
	}
	pod := fmt.Sprintf(`addr add %s/24 dev eth0
addr add %s/64 dev eth0 nodad
link set eth0 up
route add default via %s dev eth0
route add default via %s dev eth0
`, PodAddr4, PodAddr6, PodGW4, PodGW6)
	if err := testutil.IPBatch(ctx, tp.Pod, pod); err != nil {
		return err
	}
	// Return routes for the pod network only: a reply to an address that was not masqueraded
	// can come back, so the pod address can be observed at all.
	fmt.Fprintf(&ext, `addr add %s/24 dev eth0
addr add %s/64 dev eth0 nodad
link set eth0 up
route add %s via %s dev eth0
route add %s via %s dev eth0
`, ExtAddr4, ExtAddr6, PodNet4, NodeAddr4, PodNet6, NodeAddr6)
	if err := testutil.IPBatch(ctx, tp.Ext, ext.String()); err != nil {
		return err
	}
	if err := WriteSysctl(tp.Node, "net.ipv4.ip_forward", "1"); err != nil {
		return err
	}
	return WriteSysctl(tp.Node, "net.ipv6.conf.all.forwarding", "1")
}

// NodeAddr is the node's uplink address of a family: the source of a masqueraded flow.
func NodeAddr(fam policy.Family) netip.Addr {
	if fam == policy.IPv6 {
		return NodeAddr6
	}
	return NodeAddr4
}

// AddAltAddresses gives the node's uplink its second addresses, NodeAlt4 and NodeAlt6: a node
// with two addresses on its uplink.
func (tp *Topology) AddAltAddresses(ctx context.Context) error {
	return testutil.IPBatch(ctx, tp.Node, fmt.Sprintf("addr add %s/24 dev %s\naddr add %s/64 dev %s nodad preferred_lft 0\n",
		NodeAlt4, Uplink, NodeAlt6, Uplink))
}

// NodeAlt is the node's second uplink address of a family (NodeAlt4, NodeAlt6).
func NodeAlt(fam policy.Family) netip.Addr {
	if fam == policy.IPv6 {
		return NodeAlt6
	}
	return NodeAlt4
}

// PodAddr is the pod's address of a family.
func PodAddr(fam policy.Family) netip.Addr {
	if fam == policy.IPv6 {
		return PodAddr6
	}
	return PodAddr4
}

// Probe connects from the pod to dst's echo server over proto ("tcp" or "udp") and returns the
// source address and port the external host saw.
func (tp *Topology) Probe(ctx context.Context, proto string, dst netip.Addr) (netip.AddrPort, error) {
	return tp.ProbeFrom(ctx, tp.Pod, PodAddr(policy.FamilyOf(dst)), proto, dst)
}

// ProbeFrom is Probe from another namespace and address of it (a second pod, a macvlan child).
func (tp *Topology) ProbeFrom(ctx context.Context, ns string, from netip.Addr, proto string, dst netip.Addr) (netip.AddrPort, error) {
	port := uint16(tp.nextPort.Add(1))
	local := netip.AddrPortFrom(from, port)
	remote := netip.AddrPortFrom(dst, EchoPort)
	ctx, cancel := context.WithTimeout(ctx, probeWindow)
	defer cancel()
	var reply string
	err := testutil.Do(ns, func() error {
		var laddr net.Addr = net.TCPAddrFromAddrPort(local)
		if proto == "udp" {
			laddr = net.UDPAddrFromAddrPort(local)
		}
		// Dialing an address literal creates the socket in this goroutine, on this thread.
		d := net.Dialer{LocalAddr: laddr}
		conn, err := d.DialContext(ctx, proto, remote.String())
		if err != nil {
			return err
		}
		defer conn.Close()
		deadline, _ := ctx.Deadline()
		buf := make([]byte, 256)
		if proto == "tcp" {
			if err := conn.SetReadDeadline(deadline); err != nil {
				return err
			}
			n, err := conn.Read(buf)
			reply = string(buf[:n])
			return err
		}
		// UDP: ask again now and then; a datagram sent before neighbours resolve may be lost.
		for {
			if _, err := conn.Write([]byte("probe\n")); err != nil {
				return err
			}
			next := time.Now().Add(300 * time.Millisecond)
			if next.After(deadline) {
				next = deadline
			}
			if err := conn.SetReadDeadline(next); err != nil {
				return err
			}
			n, err := conn.Read(buf)
			if err == nil {
				reply = string(buf[:n])
				return nil
			}
			var ne net.Error
			if !errors.As(err, &ne) || !ne.Timeout() || !time.Now().Before(deadline) {
				return err
			}
		}
	})
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("%s probe %s -> %s: %w", proto, local, remote, err)
	}
	src, ok := strings.CutPrefix(strings.TrimSpace(reply), "from ")
	if !ok {
		return netip.AddrPort{}, fmt.Errorf("%s probe to %s: unexpected reply %q", proto, remote, reply)
	}
	ap, err := netip.ParseAddrPort(src)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("%s probe to %s: reply %q: %w", proto, remote, reply, err)
	}
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), nil
}

// Datagram sends one UDP datagram with payload from a fresh pod port to dst's echo server and
// waits for the answer: exactly one packet leaves the pod, the first of a new flow, which both
// iptables (counting connections) and BPF (counting packets) count once, with the same length.
// It does not resend: a lost datagram is an error, as the count would be unknown. It returns
// the source the external host saw.
func (tp *Topology) Datagram(ctx context.Context, dst netip.Addr, payload []byte) (netip.AddrPort, error) {
	port := uint16(tp.nextPort.Add(1))
	local := netip.AddrPortFrom(PodAddr(policy.FamilyOf(dst)), port)
	remote := netip.AddrPortFrom(dst, EchoPort)
	ctx, cancel := context.WithTimeout(ctx, probeWindow)
	defer cancel()
	var reply string
	err := testutil.Do(tp.Pod, func() error {
		d := net.Dialer{LocalAddr: net.UDPAddrFromAddrPort(local)}
		conn, err := d.DialContext(ctx, "udp", remote.String())
		if err != nil {
			return err
		}
		defer conn.Close()
		deadline, _ := ctx.Deadline()
		if err := conn.SetDeadline(deadline); err != nil {
			return err
		}
		if _, err := conn.Write(payload); err != nil {
			return err
		}
		buf := make([]byte, 256)
		n, err := conn.Read(buf)
		reply = string(buf[:n])
		return err
	})
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("datagram %s -> %s: %w", local, remote, err)
	}
	src, ok := strings.CutPrefix(strings.TrimSpace(reply), "from ")
	if !ok {
		return netip.AddrPort{}, fmt.Errorf("datagram to %s: unexpected reply %q", remote, reply)
	}
	ap, err := netip.ParseAddrPort(src)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("datagram to %s: reply %q: %w", remote, reply, err)
	}
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), nil
}

// StartEcho starts, inside ns, a TCP and a UDP echo server for every address: each answers with
// "from ADDR:PORT", the source it saw. UDP servers bind each address so that replies come from
// the address the probe was sent to. stop closes them all.
func StartEcho(ns string, addrs []netip.Addr, port uint16) (stop func(), err error) {
	var closers []func() error
	var wg sync.WaitGroup
	stop = func() {
		for _, c := range closers {
			_ = c()
		}
		wg.Wait()
	}
	err = testutil.Do(ns, func() error {
		ln, err := net.Listen("tcp", fmt.Sprintf(":%d", port)) // dual-stack, every address
		if err != nil {
			return err
		}
		closers = append(closers, ln.Close)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					defer c.Close()
					_, _ = fmt.Fprintf(c, "from %s\n", c.RemoteAddr())
					// Let the client close first: the TIME_WAIT state then stays on the pod, whose
					// ports never repeat, instead of here, where a random masquerade port could
					// meet an earlier connection's TIME_WAIT.
					_ = c.SetReadDeadline(time.Now().Add(probeWindow))
					_, _ = io.Copy(io.Discard, c)
				}()
			}
		}()
		for _, a := range addrs {
			pc, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(a, port)))
			if err != nil {
				return err
			}
			closers = append(closers, pc.Close)
			wg.Add(1)
			go func() {
				defer wg.Done()
				buf := make([]byte, 512)
				for {
					_, from, err := pc.ReadFromUDPAddrPort(buf)
					if err != nil {
						return
					}
					_, _ = pc.WriteToUDPAddrPort([]byte(fmt.Sprintf("from %s\n", from)), from)
				}
			}()
		}
		return nil
	})
	if err != nil {
		stop()
		return nil, err
	}
	return stop, nil
}
