package bpf

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"testing"
)

// fragment splits the IPv4 packet of an Ethernet frame (no options) into fragments carrying
// at most chunk bytes of payload each (a multiple of 8).
func fragment(frame []byte, chunk int) [][]byte {
	hdr, data := frame[:14+20], frame[14+20:]
	var frags [][]byte
	for off := 0; off < len(data); off += chunk {
		end := min(off+chunk, len(data))
		f := append(append([]byte(nil), hdr...), data[off:end]...)
		ip := f[14:]
		binary.BigEndian.PutUint16(ip[2:], uint16(20+end-off))
		fo := uint16(off / 8)
		if end < len(data) {
			fo |= 0x2000 // more fragments
		}
		binary.BigEndian.PutUint16(ip[6:], fo)
		ip[10], ip[11] = 0, 0
		binary.BigEndian.PutUint16(ip[10:], ^fold(sum16(ip[:20], 0)))
		frags = append(frags, f)
	}
	return frags
}

func fold(s uint32) uint16 {
	for s > 0xffff {
		s = s&0xffff + s>>16
	}
	return uint16(s)
}

// reassemble joins in-order fragments into one Ethernet frame.
func reassemble(t *testing.T, frags [][]byte) []byte {
	t.Helper()
	out := append([]byte(nil), frags[0][:14+20]...)
	for i, f := range frags {
		if err := verifyChecksums(f); err != nil {
			t.Fatalf("fragment %d: %v", i, err)
		}
		if !bytes.Equal(f[14+12:14+20], frags[0][14+12:14+20]) {
			t.Fatalf("fragment %d has addresses %v, fragment 0 %v", i, f[14+12:14+20], frags[0][14+12:14+20])
		}
		out = append(out, f[14+20:]...)
	}
	ip := out[14:]
	binary.BigEndian.PutUint16(ip[2:], uint16(len(ip)))
	binary.BigEndian.PutUint16(ip[6:], 0)
	ip[10], ip[11] = 0, 0
	binary.BigEndian.PutUint16(ip[10:], ^fold(sum16(ip[:20], 0)))
	return out
}

// TestFragments: a masqueraded datagram larger than the MTU leaves with every fragment
// translated, and a reply larger than the MTU (a big DNS answer) gets back to the pod: the first
// fragment by its ports, the later ones by the datagram id.
func TestFragments(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	for _, b := range builders(false) {
		if b.name == "tcp" {
			continue
		}
		t.Run(b.name, func(t *testing.T) {
			h.t = t
			podEnd, dst := ap(pod4(600), 5300), ap(remote4, 53)
			if b.name == "icmp-echo" {
				dst = ap(remote4, 0)
			}
			big := bytes.Repeat([]byte("fragmented datagram "), 200) // 4000 bytes
			query := withPayload(b, podEnd, dst, big, true)
			var sent [][]byte
			for i, f := range fragment(query, 1480) {
				out := h.mustPass(h.dp.Egress(), f)
				if got := netip.AddrFrom4([4]byte(out[14+12 : 14+16])); got != snat4 {
					t.Fatalf("egress fragment %d leaves from %s, want %s", i, got, snat4)
				}
				sent = append(sent, out)
			}
			whole := reassemble(t, sent)
			if err := verifyChecksums(whole); err != nil {
				t.Fatalf("reassembled datagram: %v", err)
			}
			nat := tupleOf(t, whole).src

			answer := withPayload(b, dst, nat, bytes.Repeat([]byte("large answer "), 300), false) // 3900 bytes
			frags := fragment(answer, 1480)
			var got [][]byte
			for i, f := range frags {
				out := h.mustPass(h.dp.Ingress(), f)
				if d := netip.AddrFrom4([4]byte(out[14+16 : 14+20])); d != podEnd.Addr() {
					t.Fatalf("ingress fragment %d goes to %s, want %s", i, d, podEnd.Addr())
				}
				got = append(got, out)
			}
			whole = reassemble(t, got)
			if err := verifyChecksums(whole); err != nil {
				t.Fatalf("reassembled answer: %v", err)
			}
			if tu := tupleOf(t, whole); tu.dst != podEnd || tu.src != dst {
				t.Fatalf("answer arrives as %s, want %s -> %s", tu, dst, podEnd)
			}

			// A later fragment of a datagram whose first fragment was never seen passes as is.
			misses := h.events()[EventFragMiss]
			stray := fragment(withPayload(b, dst, nat, big, false), 1480)[1]
			binary.BigEndian.PutUint16(stray[14+4:], 0x4321) // another datagram id
			stray[14+10], stray[14+11] = 0, 0
			binary.BigEndian.PutUint16(stray[14+10:], ^fold(sum16(stray[14:14+20], 0)))
			if out := h.mustPass(h.dp.Ingress(), stray); !bytes.Equal(out, stray) {
				t.Fatalf("stray fragment rewritten")
			}
			if h.events()[EventFragMiss] != misses+1 {
				t.Fatalf("stray fragment not counted")
			}
		})
	}
}

// withPayload builds the flow's packet (out) or its reply with a given payload.
func withPayload(b builder, src, dst netip.AddrPort, data []byte, out bool) []byte {
	switch b.name {
	case "udp":
		return udpPacket(src, dst, data)
	case "icmp-echo":
		if out {
			return echoPacket(src.Addr(), dst.Addr(), src.Port(), true, data)
		}
		return echoPacket(src.Addr(), dst.Addr(), dst.Port(), false, data)
	}
	panic(fmt.Sprintf("no payload builder for %s", b.name))
}
