package e2e

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// Floods and forged packets from the external host: frames built with gopacket and written
// whole to its device through an AF_PACKET socket, so that their sources are whatever the test
// says. Sources are drawn from SpoofNet4, which the external host owns (an address of it on its
// loopback): the node's answers to them go back to the external host, and nowhere else.

// SpoofNet4 is the range flood sources come from.
var SpoofNet4 = netip.MustParsePrefix("100.127.0.0/16")

// OwnSpoofNet gives the external host the flood sources' range, so that every answer to them
// stays inside the topology.
func (tp *Topology) OwnSpoofNet(ctx context.Context, t testing.TB) {
	t.Helper()
	if err := testutil.IPBatch(ctx, tp.Ext, fmt.Sprintf("addr add %s dev lo\n", netip.PrefixFrom(SpoofNet4.Addr().Next(), SpoofNet4.Bits()))); err != nil {
		t.Fatalf("own %s: %v", SpoofNet4, err)
	}
}

// SpoofSource is the i-th source of SpoofNet4 (address and port).
func SpoofSource(i int) netip.AddrPort {
	a := SpoofNet4.Addr().As4()
	n := binary.BigEndian.Uint32(a[:]) + 2 + uint32(i%60000)
	binary.BigEndian.PutUint32(a[:], n)
	return netip.AddrPortFrom(netip.AddrFrom4(a), uint16(1024+i/60000))
}

// Forger writes frames from the external host's device toward the node's uplink.
type Forger struct {
	fd       int
	src, dst net.HardwareAddr
}

// NewForger opens a raw socket on the external host's device; it is closed when the test ends.
func (tp *Topology) NewForger(t testing.TB) *Forger {
	t.Helper()
	f := &Forger{}
	var ifindex int
	err := testutil.Do(tp.Ext, func() error {
		ifc, err := net.InterfaceByName("eth0")
		if err != nil {
			return err
		}
		ifindex, f.src = ifc.Index, ifc.HardwareAddr
		// Protocol 0: the socket sends, and receives nothing.
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		f.fd = fd
		return unix.Bind(fd, &unix.SockaddrLinklayer{Ifindex: ifindex})
	})
	if err != nil {
		t.Fatalf("raw socket on the external host: %v", err)
	}
	t.Cleanup(func() { unix.Close(f.fd) })
	if err := testutil.Do(tp.Node, func() error {
		l, err := netlink.LinkByName(Uplink)
		if err == nil {
			f.dst = l.Attrs().HardwareAddr
		}
		return err
	}); err != nil {
		t.Fatalf("the node's uplink: %v", err)
	}
	return f
}

// Frame is an Ethernet frame from the external host to the node around an IPv4 packet of src ->
// dst carrying l4.
func (f *Forger) Frame(src, dst netip.Addr, proto layers.IPProtocol, l4 ...gopacket.SerializableLayer) []byte {
	eth := &layers.Ethernet{SrcMAC: f.src, DstMAC: f.dst, EthernetType: layers.EthernetTypeIPv4}
	ip := &layers.IPv4{Version: 4, IHL: 5, TTL: 64, Protocol: proto, SrcIP: src.AsSlice(), DstIP: dst.AsSlice()}
	for _, l := range l4 {
		if c, ok := l.(interface {
			SetNetworkLayerForChecksum(gopacket.NetworkLayer) error
		}); ok {
			_ = c.SetNetworkLayerForChecksum(ip)
		}
	}
	buf := gopacket.NewSerializeBuffer()
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true},
		append([]gopacket.SerializableLayer{eth, ip}, l4...)...); err != nil {
		panic(err) // the layers are the test's own
	}
	return buf.Bytes()
}

// TCPFrame is a TCP segment (flags "S", "A", "R", "F" combined) from src to dst.
func (f *Forger) TCPFrame(src, dst netip.AddrPort, flags string, seq, ack uint32) []byte {
	tcp := &layers.TCP{SrcPort: layers.TCPPort(src.Port()), DstPort: layers.TCPPort(dst.Port()), Seq: seq, Ack: ack,
		Window: 1024, SYN: strings.Contains(flags, "S"), ACK: strings.Contains(flags, "A"),
		RST: strings.Contains(flags, "R"), FIN: strings.Contains(flags, "F")}
	return f.Frame(src.Addr(), dst.Addr(), layers.IPProtocolTCP, tcp)
}

// Send writes one frame.
func (f *Forger) Send(frame []byte) error {
	_, err := unix.Write(f.fd, frame)
	return err
}

// Flood writes frame(i) for i from 0 to n-1. Each write hands its frame to the node's uplink
// (the veth's peer), which processes it within the write (the programs and the stack); one the
// node's backlog had no room for (ENOBUFS) is written again, so that all n arrive.
func (f *Forger) Flood(ctx context.Context, n int, frame func(i int) []byte) error {
	for i := 0; i < n; {
		err := f.Send(frame(i))
		switch {
		case err == nil:
			i++
		case err == unix.ENOBUFS:
			time.Sleep(100 * time.Microsecond)
		default:
			return fmt.Errorf("write frame %d: %w", i, err)
		}
		if i%4096 == 0 && ctx.Err() != nil {
			return ctx.Err()
		}
	}
	return nil
}
