package e2e

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// Protocols beyond TCP and UDP, sent and answered over raw IP sockets (the kernel builds the IP
// header; no module of the protocol is needed): address-only ones (GRE, an unassigned number)
// and SCTP (its INIT answered by an INIT ACK, so that conntrack tracks it as an association).
// The external host's responder answers every probe from the address it was sent to, with the
// source it saw in its payload.

// Protocol numbers of the raw probes.
const (
	ProtoGRE     = 47
	ProtoSCTP    = 132
	ProtoUnknown = 253 // RFC 3692 experimentation
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// rawNetwork is the net package's name of a raw IP socket of proto.
func rawNetwork(a netip.Addr, proto int) string {
	if a.Is4() {
		return fmt.Sprintf("ip4:%d", proto)
	}
	return fmt.Sprintf("ip6:%d", proto)
}

// sctpPacket is an SCTP packet of ports and verification tag holding one chunk, its CRC32c set.
func sctpPacket(sport, dport uint16, vtag uint32, chunk []byte) []byte {
	b := binary.BigEndian.AppendUint16(nil, sport)
	b = binary.BigEndian.AppendUint16(b, dport)
	b = binary.BigEndian.AppendUint32(b, vtag)
	b = append(b, 0, 0, 0, 0)
	b = append(b, chunk...)
	binary.LittleEndian.PutUint32(b[8:], crc32.Checksum(b, castagnoli))
	return b
}

// sctpValid tells whether an SCTP packet's CRC32c is right.
func sctpValid(b []byte) bool {
	if len(b) < 12 {
		return false
	}
	c := append([]byte(nil), b...)
	want := binary.LittleEndian.Uint32(c[8:])
	copy(c[8:12], []byte{0, 0, 0, 0})
	return crc32.Checksum(c, castagnoli) == want
}

// sctpChunk is a chunk of type typ whose value is the fixed part given, then a parameter of type
// 7 (a state cookie in an INIT ACK) holding text, padded to 4 bytes.
func sctpChunk(typ byte, fixed []byte, text string) []byte {
	param := binary.BigEndian.AppendUint16(nil, 7)
	param = binary.BigEndian.AppendUint16(param, uint16(4+len(text)))
	param = append(param, text...)
	for len(param)%4 != 0 {
		param = append(param, 0)
	}
	body := append(append([]byte(nil), fixed...), param...)
	c := []byte{typ, 0}
	c = binary.BigEndian.AppendUint16(c, uint16(4+len(body)))
	return append(c, body...)
}

// sctpInit is an INIT (type 1) with initiate tag tag, carrying text; its packet's verification
// tag must be 0.
func sctpInit(tag uint32, text string) []byte {
	fixed := binary.BigEndian.AppendUint32(nil, tag)
	fixed = binary.BigEndian.AppendUint32(fixed, 65535)  // a_rwnd
	fixed = append(fixed, 0, 1, 0, 1)                    // streams out, in
	fixed = binary.BigEndian.AppendUint32(fixed, 0x1000) // initial TSN
	return sctpChunk(1, fixed, text)
}

// sctpText is the text of a chunk made by sctpChunk, and its type.
func sctpText(b []byte) (byte, string, bool) {
	if len(b) < 12+4+16+4 {
		return 0, "", false
	}
	c := b[12:]
	param := c[4+16:]
	n := int(binary.BigEndian.Uint16(param[2:]))
	if n < 4 || n > len(param) {
		return 0, "", false
	}
	return c[0], string(param[4:n]), true
}

// StartRawResponder answers, inside ns, every probe of proto sent to one of addrs: address-only
// protocols with "from SOURCE", SCTP INITs with an INIT ACK holding "from SOURCE:PORT" (or "bad
// crc" when the INIT's CRC32c did not verify). stop closes the sockets.
func StartRawResponder(ns string, addrs []netip.Addr, proto int) (stop func(), err error) {
	var conns []net.PacketConn
	var wg sync.WaitGroup
	stop = func() {
		for _, c := range conns {
			_ = c.Close()
		}
		wg.Wait()
	}
	err = testutil.Do(ns, func() error {
		for _, a := range addrs {
			c, err := net.ListenPacket(rawNetwork(a, proto), a.String())
			if err != nil {
				return err
			}
			conns = append(conns, c)
			wg.Add(1)
			go func() {
				defer wg.Done()
				buf := make([]byte, 2048)
				for {
					n, from, err := c.ReadFrom(buf)
					if err != nil {
						return
					}
					src, _ := netip.AddrFromSlice(from.(*net.IPAddr).IP)
					src = src.Unmap()
					var reply []byte
					if proto == ProtoSCTP {
						in := buf[:n]
						if typ, _, ok := sctpText(in); len(in) < 12 || !ok || typ != 1 {
							continue // not an INIT of ours
						}
						sport, dport := binary.BigEndian.Uint16(in), binary.BigEndian.Uint16(in[2:])
						text := fmt.Sprintf("from %s", netip.AddrPortFrom(src, sport))
						if !sctpValid(in) {
							text = "bad crc"
						}
						tag := binary.BigEndian.Uint32(in[16:]) // the INIT's initiate tag
						fixed := binary.BigEndian.AppendUint32(nil, 0x5c7a91e5)
						fixed = binary.BigEndian.AppendUint32(fixed, 65535)
						fixed = append(fixed, 0, 1, 0, 1)
						fixed = binary.BigEndian.AppendUint32(fixed, 0x2000)
						reply = sctpPacket(dport, sport, tag, sctpChunk(2, fixed, text))
					} else {
						in := string(buf[:n])
						if proto == ProtoGRE {
							in = strings.TrimPrefix(in, "\x00\x00\x08\x00")
						}
						if !strings.HasPrefix(in, "probe") {
							continue
						}
						reply = []byte("from " + src.String())
						if proto == ProtoGRE {
							reply = append([]byte{0, 0, 0x08, 0x00}, reply...)
						}
					}
					_, _ = c.WriteTo(reply, from)
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

// RawProbe sends one probe of proto from the pod's address of dst's family to dst and returns
// the source the external host reported in its answer (the port too for SCTP). A probe gets no
// answer unless its answer comes back to the pod.
func (tp *Topology) RawProbe(ctx context.Context, proto int, dst netip.Addr) (netip.AddrPort, error) {
	from := PodAddr4
	if dst.Is6() {
		from = PodAddr6
	}
	return tp.RawProbeFrom(ctx, tp.Pod, from, proto, dst)
}

// RawProbeFrom is RawProbe from another namespace and address of it (a second pod).
func (tp *Topology) RawProbeFrom(ctx context.Context, ns string, from netip.Addr, proto int, dst netip.Addr) (netip.AddrPort, error) {
	port := uint16(tp.nextPort.Add(1))
	tag := uint32(port)<<16 | 0x7e57
	ctx, cancel := context.WithTimeout(ctx, probeWindow)
	defer cancel()
	var got netip.AddrPort
	err := testutil.Do(ns, func() error {
		c, err := net.ListenPacket(rawNetwork(from, proto), from.String())
		if err != nil {
			return err
		}
		defer c.Close()
		msg := []byte("probe")
		if proto == ProtoGRE {
			// A GRE header (no flags, version 0) carrying "IPv4": conntrack's GRE tracker
			// reads it.
			msg = append([]byte{0, 0, 0x08, 0x00}, "probe"...)
		}
		if proto == ProtoSCTP {
			msg = sctpPacket(port, 38412, 0, sctpInit(tag, "probe"))
		}
		return ask(ctx, c, msg, dst, func(in []byte) (bool, error) {
			text := string(in)
			if proto == ProtoGRE {
				text = strings.TrimPrefix(text, "\x00\x00\x08\x00")
			}
			if proto == ProtoSCTP {
				typ, t, ok := sctpText(in)
				if !ok || typ != 2 || binary.BigEndian.Uint16(in[2:]) != port || binary.BigEndian.Uint32(in[4:]) != tag {
					return false, nil // not the INIT ACK for us (an ABORT from a kernel with SCTP)
				}
				if !sctpValid(in) {
					return false, errors.New("the INIT ACK reached the pod with a bad CRC32c")
				}
				text = t
			}
			s, ok := strings.CutPrefix(text, "from ")
			if !ok {
				if text == "bad crc" {
					return false, errors.New("the external host got the INIT with a bad CRC32c")
				}
				return false, nil
			}
			var err error
			if proto == ProtoSCTP {
				got, err = netip.ParseAddrPort(s)
			} else {
				var a netip.Addr
				a, err = netip.ParseAddr(s)
				got = netip.AddrPortFrom(a, 0)
			}
			return true, err
		})
	})
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("protocol %d probe %s -> %s: %w", proto, from, dst, err)
	}
	return got, nil
}

// ICMPTimestamp sends an ICMP timestamp request from the pod to dst (an address of the external
// host, whose kernel answers it) and returns the source the request arrived from there, read by
// a raw socket of the external host; it fails when the reply does not reach the pod with the
// request's identifier.
func (tp *Topology) ICMPTimestamp(ctx context.Context, dst netip.Addr) (netip.Addr, error) {
	id := uint16(tp.nextPort.Add(1))
	ctx, cancel := context.WithTimeout(ctx, probeWindow)
	defer cancel()
	// The external host's copy of the request.
	seen := make(chan netip.Addr, 1)
	var watch net.PacketConn
	if err := testutil.Do(tp.Ext, func() error {
		var err error
		watch, err = net.ListenPacket("ip4:1", "0.0.0.0")
		return err
	}); err != nil {
		return netip.Addr{}, err
	}
	defer watch.Close()
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := watch.ReadFrom(buf)
			if err != nil {
				return
			}
			// The identifier the NAT gave it is another, under --random-fully.
			if n >= 8 && buf[0] == 13 {
				a, _ := netip.AddrFromSlice(from.(*net.IPAddr).IP)
				select {
				case seen <- a.Unmap():
				default:
				}
				return
			}
		}
	}()
	err := testutil.Do(tp.Pod, func() error {
		c, err := net.ListenPacket("ip4:1", PodAddr4.String())
		if err != nil {
			return err
		}
		defer c.Close()
		req := []byte{13, 0, 0, 0, byte(id >> 8), byte(id), 0, 1}
		req = append(req, make([]byte, 12)...) // originate, receive, transmit timestamps
		var s uint32
		for i := 0; i < len(req); i += 2 {
			s += uint32(req[i])<<8 | uint32(req[i+1])
		}
		for s > 0xffff {
			s = s&0xffff + s>>16
		}
		binary.BigEndian.PutUint16(req[2:], ^uint16(s))
		return ask(ctx, c, req, dst, func(in []byte) (bool, error) {
			// The reply, with the pod's identifier.
			return len(in) >= 20 && in[0] == 14 && binary.BigEndian.Uint16(in[4:]) == id, nil
		})
	})
	if err != nil {
		return netip.Addr{}, fmt.Errorf("ICMP timestamp %s -> %s: %w", PodAddr4, dst, err)
	}
	select {
	case a := <-seen:
		return a, nil
	case <-ctx.Done():
		return netip.Addr{}, errors.New("the external host saw no timestamp request")
	}
}

// UDPWithDestOpts sends a UDP datagram from the pod over IPv6 with a destination options header
// (a PadN option, set on the socket: the kernel builds the header) to dst's echo server and
// returns the source the external host saw.
func (tp *Topology) UDPWithDestOpts(ctx context.Context, dst netip.Addr) (netip.AddrPort, error) {
	port := uint16(tp.nextPort.Add(1))
	local := netip.AddrPortFrom(PodAddr6, port)
	ctx, cancel := context.WithTimeout(ctx, probeWindow)
	defer cancel()
	var reply string
	err := testutil.Do(tp.Pod, func() error {
		conn, err := net.DialUDP("udp6", net.UDPAddrFromAddrPort(local), net.UDPAddrFromAddrPort(netip.AddrPortFrom(dst, EchoPort)))
		if err != nil {
			return err
		}
		defer conn.Close()
		raw, err := conn.SyscallConn()
		if err != nil {
			return err
		}
		var serr error
		// Next header and length (the kernel fills the first), then PadN of 4 bytes.
		opts := string([]byte{0, 0, 1, 4, 0, 0, 0, 0})
		if err := raw.Control(func(fd uintptr) {
			serr = unix.SetsockoptString(int(fd), unix.IPPROTO_IPV6, unix.IPV6_DSTOPTS, opts)
		}); err != nil {
			return err
		}
		if serr != nil {
			return fmt.Errorf("IPV6_DSTOPTS: %w", serr)
		}
		deadline, _ := ctx.Deadline()
		buf := make([]byte, 256)
		for time.Now().Before(deadline) {
			if _, err := conn.Write([]byte("probe\n")); err != nil {
				return err
			}
			if err := conn.SetReadDeadline(soon(deadline)); err != nil {
				return err
			}
			n, err := conn.Read(buf)
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			if err != nil {
				return err
			}
			reply = string(buf[:n])
			return nil
		}
		return errors.New("no answer")
	})
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("UDP with destination options %s -> %s: %w", local, dst, err)
	}
	s, _ := strings.CutPrefix(strings.TrimSpace(reply), "from ")
	ap, err := netip.ParseAddrPort(s)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("reply %q: %w", reply, err)
	}
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), nil
}

// ask sends msg to dst over c and hands each packet c reads to answer until answer says it was
// the answer or fails; with no answer it asks again every try (see soon), since the first may
// be lost while neighbours resolve, until ctx's deadline.
func ask(ctx context.Context, c net.PacketConn, msg []byte, dst netip.Addr, answer func([]byte) (bool, error)) error {
	deadline, _ := ctx.Deadline()
	buf := make([]byte, 2048)
	for time.Now().Before(deadline) {
		if _, err := c.WriteTo(msg, &net.IPAddr{IP: dst.AsSlice()}); err != nil {
			return err
		}
		if err := c.SetReadDeadline(soon(deadline)); err != nil {
			return err
		}
		for {
			n, _, err := c.ReadFrom(buf)
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				break
			}
			if err != nil {
				return err
			}
			if done, err := answer(buf[:n]); done || err != nil {
				return err
			}
		}
	}
	return errors.New("no answer")
}

// soon is a read deadline for one try of a probe: 300 ms from now, or deadline if sooner.
func soon(deadline time.Time) time.Time {
	if t := time.Now().Add(300 * time.Millisecond); t.Before(deadline) {
		return t
	}
	return deadline
}

// startRawResponders starts the responders of the raw protocols on the external host's public
// destinations, for the test's length.
func startRawResponders(t testing.TB, env *Env) {
	t.Helper()
	for _, proto := range []int{ProtoGRE, ProtoUnknown, ProtoSCTP} {
		stop, err := StartRawResponder(env.Ext, []netip.Addr{netip.MustParseAddr("8.8.8.8"), netip.MustParseAddr("2001:4860:4860::8888")}, proto)
		if err != nil {
			t.Fatalf("raw responder of protocol %d: %v", proto, err)
		}
		t.Cleanup(stop)
	}
}
