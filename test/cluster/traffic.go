package cluster

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
)

// The traffic is this process's sockets in the cluster's namespaces: whoami servers that answer
// every TCP connection and UDP datagram with the peer's address as they saw it, and clients that
// read the answer. What the server saw is the address after every translation on the way: the
// agent's masquerade, kube-proxy's DNAT and masquerade.

// WhoamiPort is the port every whoami server listens on.
const WhoamiPort = 9000

// serveWhoami listens on TCP and UDP port of each address in the network namespace whose file
// is nsPath (every address of it when none is given), until the test ends. A UDP socket is
// bound to each address so that its answers leave from the address the client asked.
func serveWhoami(t testing.TB, nsPath string, port int, addrs ...netip.Addr) {
	t.Helper()
	if len(addrs) == 0 {
		addrs = []netip.Addr{{}}
	}
	for _, a := range addrs {
		serveWhoamiOn(t, nsPath, port, a)
	}
}

func serveWhoamiOn(t testing.TB, nsPath string, port int, a netip.Addr) {
	t.Helper()
	var ln net.Listener
	var pc net.PacketConn
	addr := fmt.Sprintf(":%d", port)
	if a.IsValid() {
		addr = netip.AddrPortFrom(a, uint16(port)).String()
	}
	if err := cluster.DoIn(nsPath, func() (err error) {
		if ln, err = net.Listen("tcp", addr); err != nil {
			return err
		}
		pc, err = net.ListenPacket("udp", addr)
		return err
	}); err != nil {
		t.Fatalf("whoami in %s: %v", nsPath, err)
	}
	t.Cleanup(func() { ln.Close(); pc.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go answerTCP(conn)
		}
	}()
	go func() {
		buf := make([]byte, 1500)
		for {
			_, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo([]byte(from.String()+"\n"), from)
		}
	}()
}

// answerTCP writes the peer's address on each line the peer sends, so that one long-lived
// connection can be asked again and again.
func answerTCP(conn net.Conn) {
	defer conn.Close()
	r := bufio.NewReader(conn)
	for {
		if _, err := r.ReadString('\n'); err != nil {
			return
		}
		if _, err := conn.Write([]byte(conn.RemoteAddr().String() + "\n")); err != nil {
			return
		}
	}
}

// client is where connections start: a network namespace and, optionally, a source address
// and port.
type client struct {
	name   string
	nsPath string
	src    netip.Addr
	port   uint16
}

// freshPorts hands out source ports below the kernel's ephemeral range (32768 and up), each
// once per test process, for a flow that must be new: a UDP socket on a random ephemeral port
// may reuse the 5-tuple of an earlier probe whose translation conntrack (and the BPF
// datapath, alike) still holds, and so keep that probe's verdict.
var freshPorts atomic.Uint32

// fresh returns cl with a source port no earlier flow of this process used.
func (cl client) fresh() client {
	cl.port = uint16(20000 + freshPorts.Add(1)%12000)
	return cl
}

// whoami asks the server at dst over proto ("tcp" or "udp") and returns the address it saw.
func (cl client) whoami(ctx context.Context, proto string, dst netip.AddrPort) (netip.Addr, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var laddr net.Addr
	if cl.src.IsValid() || cl.port != 0 {
		var ip net.IP
		if cl.src.IsValid() {
			ip = cl.src.AsSlice()
		}
		if proto == "tcp" {
			laddr = &net.TCPAddr{IP: ip, Port: int(cl.port)}
		} else {
			laddr = &net.UDPAddr{IP: ip, Port: int(cl.port)}
		}
	}
	conn, err := cluster.Dialer(cl.nsPath, laddr)(ctx, proto, dst.String())
	if err != nil {
		return netip.Addr{}, err
	}
	defer conn.Close()
	f := &flow{conn: conn, r: bufio.NewReader(conn), proto: proto}
	return f.ask(ctx)
}

// flow is one long-lived connection (TCP) or socket (UDP) to a whoami server.
type flow struct {
	conn  net.Conn
	r     *bufio.Reader
	proto string
}

// ask sends a line and returns the address the server saw. UDP asks a few times: a datagram may
// be lost while a rule is being replaced, a reply may not (the flow's mapping must hold).
func (f *flow) ask(ctx context.Context) (netip.Addr, error) {
	tries := 1
	if f.proto == "udp" {
		tries = 3
	}
	var last error
	for i := 0; i < tries; i++ {
		deadline := time.Now().Add(2 * time.Second)
		if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
			deadline = d
		}
		_ = f.conn.SetDeadline(deadline)
		if _, err := f.conn.Write([]byte("?\n")); err != nil {
			return netip.Addr{}, err
		}
		line, err := f.r.ReadString('\n')
		if err != nil {
			last = err
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() && f.proto == "udp" {
				f.r.Reset(f.conn)
				continue
			}
			return netip.Addr{}, err
		}
		ap, err := netip.ParseAddrPort(strings.TrimSpace(line))
		if err != nil {
			return netip.Addr{}, fmt.Errorf("whoami answered %q: %w", line, err)
		}
		return ap.Addr().Unmap(), nil
	}
	return netip.Addr{}, last
}

// open opens a long-lived flow from the client to dst.
func (cl client) open(ctx context.Context, proto string, dst netip.AddrPort) (*flow, error) {
	var laddr net.Addr
	if cl.src.IsValid() {
		laddr = &net.TCPAddr{IP: cl.src.AsSlice()}
		if proto == "udp" {
			laddr = &net.UDPAddr{IP: cl.src.AsSlice()}
		}
	}
	conn, err := cluster.Dialer(cl.nsPath, laddr)(ctx, proto, dst.String())
	if err != nil {
		return nil, err
	}
	return &flow{conn: conn, r: bufio.NewReader(conn), proto: proto}, nil
}
