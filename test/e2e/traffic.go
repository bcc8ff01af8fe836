package e2e

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// Traffic helpers beyond the one-shot probes: a second pod, long-lived connections, an echo
// server that answers every line and echoes datagrams whole, and the external host's routes
// back to the pods (without them, only masqueraded traffic is answered).

// LinePort is where StartLineEcho listens.
const LinePort = 7778

// AddPod adds a pod namespace behind the node, on its own /24 and /64 of the pod networks
// (index 2 and up; the topology's pod is 1), and returns the namespace and its addresses.
func (tp *Topology) AddPod(ctx context.Context, t testing.TB, index int) (ns string, addr4, addr6 netip.Addr) {
	t.Helper()
	ns = testutil.NewNetns(t)
	addr4 = netip.AddrFrom4([4]byte{10, 244, byte(index), 2})
	addr6 = netip.MustParseAddr(fmt.Sprintf("fd00:10:244:%x::2", index))
	gw4 := netip.AddrFrom4([4]byte{10, 244, byte(index), 1})
	gw6 := netip.MustParseAddr(fmt.Sprintf("fd00:10:244:%x::1", index))
	if err := WriteSysctl(ns, "net.ipv6.conf.all.accept_dad", "0"); err != nil {
		t.Fatal(err)
	}
	dev := fmt.Sprintf("pod%d", index)
	if err := testutil.IPBatch(ctx, tp.Node, fmt.Sprintf(`link add %s type veth peer name eth0 netns %s
addr add %s/24 dev %s
addr add %s/64 dev %s nodad
link set %s up
`, dev, ns, gw4, dev, gw6, dev, dev)); err != nil {
		t.Fatalf("add pod: %v", err)
	}
	if err := testutil.IPBatch(ctx, ns, fmt.Sprintf(`link set lo up
addr add %s/24 dev eth0
addr add %s/64 dev eth0 nodad
link set eth0 up
route add default via %s dev eth0
route add default via %s dev eth0
`, addr4, addr6, gw4, gw6)); err != nil {
		t.Fatalf("add pod: %v", err)
	}
	return ns, addr4, addr6
}

// CutReturnRoutes removes the external host's routes to the pod networks: from then on a flow
// that keeps its pod address gets no answer, so every answer proves a masquerade (and its
// translation back). RestoreReturnRoutes puts them back.
func (tp *Topology) CutReturnRoutes(ctx context.Context, t testing.TB) {
	t.Helper()
	if err := testutil.IPBatch(ctx, tp.Ext, fmt.Sprintf("route del %s\nroute del %s\n", PodNet4, PodNet6)); err != nil {
		t.Fatalf("cut return routes: %v", err)
	}
}

// RestoreReturnRoutes undoes CutReturnRoutes.
func (tp *Topology) RestoreReturnRoutes(ctx context.Context, t testing.TB) {
	t.Helper()
	if err := testutil.IPBatch(ctx, tp.Ext, fmt.Sprintf("route add %s via %s dev eth0\nroute add %s via %s dev eth0\n",
		PodNet4, NodeAddr4, PodNet6, NodeAddr6)); err != nil {
		t.Fatalf("restore return routes: %v", err)
	}
}

// StartLineEcho starts, inside ns and on every address, a TCP server that answers each line
// with "from SRC LINE" and a UDP server that answers each datagram with "from SRC\n" followed by
// the datagram itself (so that a large datagram gets an equally large answer). The servers stop
// when the test ends.
func StartLineEcho(t testing.TB, ns string, addrs []netip.Addr) {
	t.Helper()
	startLineEcho(t, ns, true, addrs)
}

// StartLineEchoUDP starts the UDP servers of StartLineEcho alone, on addrs: for addresses the
// namespace gets after its TCP server started.
func StartLineEchoUDP(t testing.TB, ns string, addrs []netip.Addr) {
	t.Helper()
	startLineEcho(t, ns, false, addrs)
}

func startLineEcho(t testing.TB, ns string, withTCP bool, addrs []netip.Addr) {
	t.Helper()
	var closers []func() error
	var wg sync.WaitGroup
	t.Cleanup(func() {
		for _, c := range closers {
			_ = c()
		}
		wg.Wait()
	})
	err := testutil.Do(ns, func() error {
		if withTCP {
			closeTCP, err := lineEchoTCP(&wg)
			if err != nil {
				return err
			}
			closers = append(closers, closeTCP)
		}
		for _, a := range addrs {
			pc, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(a, LinePort)))
			if err != nil {
				return err
			}
			closers = append(closers, pc.Close)
			wg.Add(1)
			go func() {
				defer wg.Done()
				buf := make([]byte, 65536)
				for {
					n, from, err := pc.ReadFromUDPAddrPort(buf)
					if err != nil {
						return
					}
					reply := append([]byte(fmt.Sprintf("from %s\n", from)), buf[:n]...)
					_, _ = pc.WriteToUDPAddrPort(reply, from)
				}
			}()
		}
		return nil
	})
	if err != nil {
		t.Fatalf("line echo in %s: %v", ns, err)
	}
}

// lineEchoTCP starts the line echo's TCP server on every address of the calling thread's
// namespace, its goroutines counted in wg; the returned function stops it and its connections.
func lineEchoTCP(wg *sync.WaitGroup) (func() error, error) {
	ln, err := net.Listen("tcp", fmt.Sprintf(":%d", LinePort))
	if err != nil {
		return nil, err
	}
	var mu sync.Mutex
	conns := map[net.Conn]bool{}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns[c] = true
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				sc := bufio.NewScanner(c)
				for sc.Scan() {
					if _, err := fmt.Fprintf(c, "from %s %s\n", c.RemoteAddr(), sc.Text()); err != nil {
						return
					}
				}
			}()
		}
	}()
	return func() error {
		err := ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for c := range conns {
			c.Close()
		}
		return err
	}, nil
}

// Conn is a TCP connection, or a UDP flow (a connected socket), to a StartLineEcho server,
// held open across steps of a test.
type Conn struct {
	c   net.Conn
	rd  *bufio.Reader
	udp bool
}

// DialLine connects from local (an address of ns; port 0 picks one) to the line echo server
// at dst.
func DialLine(ctx context.Context, ns string, local netip.AddrPort, dst netip.Addr) (*Conn, error) {
	return Dial(ctx, ns, "tcp", local, netip.AddrPortFrom(dst, LinePort))
}

// DialLineUDP opens a UDP flow from local (an address of ns; port 0 picks one) to the line echo
// server at dst: a connected socket, so that every exchange is the same flow.
func DialLineUDP(ctx context.Context, ns string, local netip.AddrPort, dst netip.Addr) (*Conn, error) {
	return Dial(ctx, ns, "udp", local, netip.AddrPortFrom(dst, LinePort))
}

// Dial connects over proto ("tcp" or "udp") from local (an address of ns; port 0 picks one) to
// a line echo server reached at dst, such as a Service address that kube-proxy's rules send
// there. A UDP flow is a connected socket: it takes only answers from dst.
func Dial(ctx context.Context, ns, proto string, local, dst netip.AddrPort) (*Conn, error) {
	var c net.Conn
	err := testutil.Do(ns, func() error {
		d := net.Dialer{Timeout: probeWindow}
		if local.IsValid() {
			d.LocalAddr = net.TCPAddrFromAddrPort(local)
			if proto == "udp" {
				d.LocalAddr = net.UDPAddrFromAddrPort(local)
			}
		}
		var err error
		c, err = d.DialContext(ctx, proto, dst.String())
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("%s %s -> %s: %w", proto, local, dst, err)
	}
	if proto == "udp" {
		return &Conn{c: c, udp: true}, nil
	}
	return &Conn{c: c, rd: bufio.NewReader(c)}, nil
}

// Exchange sends a line and returns the source the server saw. Over UDP the line is sent again
// every 300 ms until an answer to it comes (within the probe window), as a UDP client would.
func (c *Conn) Exchange(line string) (netip.AddrPort, error) {
	if c.udp {
		return c.exchangeUDP(line)
	}
	if err := c.c.SetDeadline(time.Now().Add(probeWindow)); err != nil {
		return netip.AddrPort{}, err
	}
	if _, err := fmt.Fprintln(c.c, line); err != nil {
		return netip.AddrPort{}, fmt.Errorf("send %q: %w", line, err)
	}
	reply, err := c.rd.ReadString('\n')
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("answer to %q: %w", line, err)
	}
	return parseAnswer(line, reply)
}

func (c *Conn) exchangeUDP(line string) (netip.AddrPort, error) {
	deadline := time.Now().Add(probeWindow)
	buf := make([]byte, 512)
	for {
		if _, err := fmt.Fprintln(c.c, line); err != nil {
			return netip.AddrPort{}, fmt.Errorf("send %q: %w", line, err)
		}
		next := time.Now().Add(300 * time.Millisecond)
		if next.After(deadline) {
			next = deadline
		}
		if err := c.c.SetReadDeadline(next); err != nil {
			return netip.AddrPort{}, err
		}
		n, err := c.c.Read(buf)
		if ne, ok := err.(net.Error); ok && ne.Timeout() && time.Now().Before(deadline) {
			continue
		}
		if err != nil {
			return netip.AddrPort{}, fmt.Errorf("answer to %q: %w", line, err)
		}
		// "from SRC\n" and the datagram, which is the line and its newline.
		head, body, _ := strings.Cut(string(buf[:n]), "\n")
		if body != line+"\n" {
			continue // the answer to an earlier send of an earlier line
		}
		return parseAnswer(line, head+" "+line)
	}
}

// parseAnswer reads the source out of the server's "from SRC LINE" answer to line.
func parseAnswer(line, reply string) (netip.AddrPort, error) {
	f := strings.Fields(reply)
	if len(f) != 3 || f[0] != "from" || f[2] != line {
		return netip.AddrPort{}, fmt.Errorf("answer to %q: %q", line, reply)
	}
	ap, err := netip.ParseAddrPort(f[1])
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("answer to %q: %w", line, err)
	}
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), nil
}

// Local is the connection's own address and port.
func (c *Conn) Local() netip.AddrPort {
	if c.udp {
		return c.c.LocalAddr().(*net.UDPAddr).AddrPort()
	}
	return c.c.LocalAddr().(*net.TCPAddr).AddrPort()
}

// Close closes the connection.
func (c *Conn) Close() error { return c.c.Close() }

// BigDatagram sends one UDP datagram of size bytes from ns to the line echo server at dst and
// returns the source the server saw; the answer must carry the datagram back intact.
func BigDatagram(ctx context.Context, ns string, dst netip.Addr, size int) (netip.AddrPort, error) {
	payload := make([]byte, size)
	for i := range payload {
		payload[i] = byte('a' + i%26)
	}
	var src netip.AddrPort
	err := testutil.Do(ns, func() error {
		ctx, cancel := context.WithTimeout(ctx, probeWindow)
		defer cancel()
		c, err := (&net.Dialer{}).DialContext(ctx, "udp", netip.AddrPortFrom(dst, LinePort).String())
		if err != nil {
			return err
		}
		defer c.Close()
		deadline, _ := ctx.Deadline()
		buf := make([]byte, 65536)
		// Ask again now and then: the first fragments may meet unresolved neighbours.
		for {
			if _, err := c.Write(payload); err != nil {
				return err
			}
			next := time.Now().Add(300 * time.Millisecond)
			if next.After(deadline) {
				next = deadline
			}
			if err := c.SetReadDeadline(next); err != nil {
				return err
			}
			n, err := c.Read(buf)
			if err != nil {
				if ne, ok := err.(net.Error); ok && ne.Timeout() && time.Now().Before(deadline) {
					continue
				}
				return err
			}
			head, body, ok := strings.Cut(string(buf[:n]), "\n")
			if !ok || body != string(payload) {
				return fmt.Errorf("answer of %d bytes does not carry the datagram back", n)
			}
			ap, err := netip.ParseAddrPort(strings.TrimPrefix(head, "from "))
			if err != nil {
				return err
			}
			src = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
			return nil
		}
	})
	if err != nil {
		return src, fmt.Errorf("udp datagram of %d bytes to %s: %w", size, dst, err)
	}
	return src, nil
}

// UDPFlows opens flows masqueraded UDP flows from ns toward dst, one datagram each, as fast as
// the veths take them: from sockets pod sockets (ports 5000 and up) to consecutive ports of dst
// from 10000 (flows/sockets ports each, at most 55000). Nobody listens at dst on those ports;
// dst's ICMP errors (rate-limited by its kernel) are the only answer. Sending again refreshes
// the same flows.
func UDPFlows(ctx context.Context, ns string, dst netip.Addr, sockets, flows int) error {
	perSocket := (flows + sockets - 1) / sockets
	if perSocket > 55000 {
		return fmt.Errorf("%d flows from %d sockets: at most 55000 ports each", flows, sockets)
	}
	return testutil.Do(ns, func() error {
		payload := []byte("x")
		sent := 0
		for i := range sockets {
			conn, err := net.ListenUDP("udp", &net.UDPAddr{Port: 5000 + i})
			if err != nil {
				return err
			}
			for p := 0; p < perSocket && sent < flows; p++ {
				if err := ctx.Err(); err != nil {
					conn.Close()
					return err
				}
				if _, err := conn.WriteToUDPAddrPort(payload, netip.AddrPortFrom(dst, uint16(10000+p))); err != nil {
					conn.Close()
					return err
				}
				sent++
				if sent%500 == 0 {
					time.Sleep(time.Millisecond) // let the backlog drain: the veths drop beyond it
				}
			}
			conn.Close()
		}
		return nil
	})
}

// WaitListening waits until a TCP server in ns accepts connections at addr: a process started
// in the background listens a moment later, and connections before that are refused.
func WaitListening(ctx context.Context, t testing.TB, ns string, addr netip.AddrPort) {
	t.Helper()
	if err := testutil.PollContext(ctx, 10*time.Millisecond, func() error {
		if err := testutil.Do(ns, func() error {
			c, err := net.DialTimeout("tcp", addr.String(), time.Second)
			if err == nil {
				c.Close()
			}
			return err
		}); err != nil {
			return testutil.NotYet("%v", err)
		}
		return nil
	}); err != nil {
		t.Fatalf("%s does not listen in %s: %v", addr, ns, err)
	}
}

// UDPLine is a connected UDP socket from a pod to a StartLineEcho server, held across steps of a
// test: one flow, as long as it keeps its source port.
type UDPLine struct{ c net.Conn }

// DialUDPLine opens a UDP socket in ns toward the line echo server at dst.
func DialUDPLine(ctx context.Context, ns string, dst netip.Addr) (*UDPLine, error) {
	var c net.Conn
	err := testutil.Do(ns, func() error {
		var err error
		c, err = (&net.Dialer{}).DialContext(ctx, "udp", netip.AddrPortFrom(dst, LinePort).String())
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("udp socket to %s:%d: %w", dst, LinePort, err)
	}
	return &UDPLine{c: c}, nil
}

// Exchange sends a datagram and returns the source the server saw, sending again now and then
// until an answer comes or probeWindow ends (a datagram may meet unresolved neighbours).
func (u *UDPLine) Exchange(line string) (netip.AddrPort, error) {
	deadline := time.Now().Add(probeWindow)
	buf := make([]byte, 512)
	for {
		if _, err := u.c.Write([]byte(line)); err != nil {
			return netip.AddrPort{}, fmt.Errorf("send %q: %w", line, err)
		}
		next := time.Now().Add(300 * time.Millisecond)
		if next.After(deadline) {
			next = deadline
		}
		if err := u.c.SetReadDeadline(next); err != nil {
			return netip.AddrPort{}, err
		}
		n, err := u.c.Read(buf)
		if err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() && time.Now().Before(deadline) {
				continue
			}
			return netip.AddrPort{}, fmt.Errorf("answer to %q: %w", line, err)
		}
		head, body, ok := strings.Cut(string(buf[:n]), "\n")
		if !ok || body != line {
			continue // the answer to an earlier send
		}
		ap, err := netip.ParseAddrPort(strings.TrimPrefix(head, "from "))
		if err != nil {
			return netip.AddrPort{}, fmt.Errorf("answer to %q: %w", line, err)
		}
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), nil
	}
}

// Close closes the socket.
func (u *UDPLine) Close() error { return u.c.Close() }

// connProbe is one connection to a line echo server reached at dst (a Service address that
// kube-proxy's rules send to a pod, a host socket) from a client address of ns; want is the
// source the server must see, given the client's own end (PodGW when kube-proxy masquerades it).
type connProbe struct {
	what string
	ns   string
	from netip.Addr
	dst  netip.AddrPort
	want func(local netip.AddrPort) netip.Addr
}

// run connects, exchanges two lines, and returns what went wrong ("" when nothing did): the
// answers must come from dst (a connected socket takes no other) and name the source want says.
func (p connProbe) run(ctx context.Context, proto string) string {
	c, err := Dial(ctx, p.ns, proto, netip.AddrPortFrom(p.from, 0), p.dst)
	if err != nil {
		return err.Error()
	}
	defer c.Close()
	for i := range 2 {
		seen, err := c.Exchange(fmt.Sprintf("%s-%d", proto, i))
		if err != nil {
			return fmt.Sprintf("%s: %v", p.what, err)
		}
		if want := p.want(c.Local()); seen.Addr() != want {
			return fmt.Sprintf("%s: the pod saw %s, want %s", p.what, seen, want)
		}
	}
	return ""
}
