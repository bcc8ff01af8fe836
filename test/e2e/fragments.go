package e2e

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"testing"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// Fragmented datagrams sent in an order of the test's choosing: a UDP datagram built whole (its
// checksum over all of it), cut into IP fragments as a sending stack cuts them (IPv4 flags and
// offset; IPv6 a fragment header), and written frame by frame to a device through an AF_PACKET
// socket, so that the fragments reach the node in exactly that order.

// Link writes Ethernet frames from a device of a namespace to the device at its other end.
type Link struct {
	fd       int
	src, dst net.HardwareAddr
}

// OpenLink opens a raw socket on device dev of ns, whose frames go to peer (a device of
// peerNS): their MAC addresses are the frames' source and destination. The socket is closed when
// the test ends.
func OpenLink(t testing.TB, ns, dev, peerNS, peer string) *Link {
	t.Helper()
	l := &Link{}
	err := testutil.Do(ns, func() error {
		ifc, err := net.InterfaceByName(dev)
		if err != nil {
			return err
		}
		l.src = ifc.HardwareAddr
		// Protocol 0: the socket sends, and receives nothing.
		if l.fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0); err != nil {
			return err
		}
		return unix.Bind(l.fd, &unix.SockaddrLinklayer{Ifindex: ifc.Index})
	})
	if err == nil {
		err = testutil.Do(peerNS, func() error {
			ifc, err := net.InterfaceByName(peer)
			if err == nil {
				l.dst = ifc.HardwareAddr
			}
			return err
		})
	}
	if err != nil {
		t.Fatalf("raw socket on %s of %s toward %s: %v", dev, ns, peer, err)
	}
	t.Cleanup(func() { unix.Close(l.fd) })
	return l
}

// Send writes frames in the order given.
func (l *Link) Send(frames ...[]byte) error {
	for i, f := range frames {
		if _, err := unix.Write(l.fd, f); err != nil {
			return fmt.Errorf("write frame %d: %w", i, err)
		}
	}
	return nil
}

// UDPFragments is a UDP datagram from src to dst carrying payload, as n fragments in order
// (the first carries the UDP header), each an Ethernet frame of the link; id is the datagram's
// identification (16 bits of it for IPv4).
func (l *Link) UDPFragments(src, dst netip.AddrPort, payload []byte, id uint32, n int) [][]byte {
	udp := &layers.UDP{SrcPort: layers.UDPPort(src.Port()), DstPort: layers.UDPPort(dst.Port())}
	var ip gopacket.SerializableLayer
	hdr := 20
	if src.Addr().Is4() {
		ip4 := &layers.IPv4{Version: 4, IHL: 5, TTL: 64, Protocol: layers.IPProtocolUDP, Id: uint16(id),
			SrcIP: src.Addr().AsSlice(), DstIP: dst.Addr().AsSlice()}
		_ = udp.SetNetworkLayerForChecksum(ip4)
		ip = ip4
	} else {
		ip6 := &layers.IPv6{Version: 6, HopLimit: 64, NextHeader: layers.IPProtocolUDP,
			SrcIP: src.Addr().AsSlice(), DstIP: dst.Addr().AsSlice()}
		_ = udp.SetNetworkLayerForChecksum(ip6)
		ip, hdr = ip6, 40
	}
	buf := gopacket.NewSerializeBuffer()
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true},
		ip, udp, gopacket.Payload(payload)); err != nil {
		panic(err) // the layers are the test's own
	}
	whole := buf.Bytes()
	header, data := whole[:hdr], whole[hdr:]
	chunk := (len(data)/n + 7) &^ 7
	var frames [][]byte
	for off := 0; off < len(data); off += chunk {
		end := min(off+chunk, len(data))
		frames = append(frames, l.frame(header, data[off:end], off, end < len(data), id))
	}
	return frames
}

// frame is the Ethernet frame of the fragment of the datagram with IP header header that holds
// piece at offset off of its payload.
func (l *Link) frame(header, piece []byte, off int, more bool, id uint32) []byte {
	eth := append(append(append([]byte(nil), l.dst...), l.src...), 0x08, 0x00)
	if header[0]>>4 == 4 {
		ip := append([]byte(nil), header...)
		binary.BigEndian.PutUint16(ip[2:], uint16(len(ip)+len(piece)))
		fo := uint16(off / 8)
		if more {
			fo |= 0x2000
		}
		binary.BigEndian.PutUint16(ip[6:], fo)
		ip[10], ip[11] = 0, 0
		binary.BigEndian.PutUint16(ip[10:], ipChecksum(ip))
		return append(append(eth, ip...), piece...)
	}
	eth[12], eth[13] = 0x86, 0xdd
	ip := append([]byte(nil), header...)
	ip[6] = 44 // a fragment header follows
	binary.BigEndian.PutUint16(ip[4:], uint16(8+len(piece)))
	fo := uint16(off/8) << 3
	if more {
		fo |= 1
	}
	fh := []byte{header[6], 0, byte(fo >> 8), byte(fo), byte(id >> 24), byte(id >> 16), byte(id >> 8), byte(id)}
	return append(append(append(eth, ip...), fh...), piece...)
}

// ipChecksum is the IPv4 header checksum of hdr (its checksum field zero).
func ipChecksum(hdr []byte) uint16 {
	var s uint32
	for i := 0; i+1 < len(hdr); i += 2 {
		s += uint32(binary.BigEndian.Uint16(hdr[i:]))
	}
	for s > 0xffff {
		s = s&0xffff + s>>16
	}
	return ^uint16(s)
}

// htons is v in network byte order, as the socket calls take protocol numbers.
func htons(v uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], v)
	return binary.NativeEndian.Uint16(b[:])
}

// Reversed is frames last first.
func Reversed(frames [][]byte) [][]byte {
	out := make([][]byte, len(frames))
	for i, f := range frames {
		out[len(frames)-1-i] = f
	}
	return out
}

// Sniffer counts the IP packets a device of a namespace sees (both ways) whose source is one of
// a set of addresses.
type Sniffer struct {
	fd            int
	done, stopped chan struct{}
	count         int
}

// StartSniffer starts counting the packets on dev of ns from any of srcs; Stop ends it.
func StartSniffer(t testing.TB, ns, dev string, srcs ...netip.Addr) *Sniffer {
	t.Helper()
	s := &Sniffer{done: make(chan struct{}), stopped: make(chan struct{})}
	err := testutil.Do(ns, func() error {
		ifc, err := net.InterfaceByName(dev)
		if err != nil {
			return err
		}
		// ETH_P_ALL: only such sockets see what the device sends as well as what it receives.
		if s.fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL))); err != nil {
			return err
		}
		tv := unix.NsecToTimeval(int64(100 * 1e6))
		if err := unix.SetsockoptTimeval(s.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
			return err
		}
		return unix.Bind(s.fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifc.Index})
	})
	if err != nil {
		t.Fatalf("sniffer on %s of %s: %v", dev, ns, err)
	}
	go func() {
		defer close(s.stopped)
		buf := make([]byte, 65536)
		for {
			select {
			case <-s.done:
				return
			default:
			}
			n, _, err := unix.Recvfrom(s.fd, buf, 0)
			if err == nil && packetFrom(buf[:n], srcs) {
				s.count++
			}
		}
	}()
	t.Cleanup(func() { s.Stop(); unix.Close(s.fd) })
	return s
}

// Stop ends the counting and returns the count; it may be called again.
func (s *Sniffer) Stop() int {
	select {
	case <-s.done:
	default:
		close(s.done)
	}
	<-s.stopped
	return s.count
}

// packetFrom tells whether an Ethernet frame carries an IP packet from one of srcs.
func packetFrom(frame []byte, srcs []netip.Addr) bool {
	if len(frame) < 14+40 {
		return false
	}
	var src netip.Addr
	switch binary.BigEndian.Uint16(frame[12:]) {
	case 0x0800:
		src = netip.AddrFrom4([4]byte(frame[14+12 : 14+16]))
	case 0x86dd:
		src = netip.AddrFrom16([16]byte(frame[14+8 : 14+24]))
	default:
		return false
	}
	for _, a := range srcs {
		if a == src {
			return true
		}
	}
	return false
}
