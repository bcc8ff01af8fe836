package bpf

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"
)

// fragment splits the IP packet of an Ethernet frame (IPv4 without options, or IPv6 without
// extension headers) into fragments carrying at most chunk bytes of payload each (a multiple
// of 8), as a sending stack would.
func fragment(frame []byte, chunk int) [][]byte {
	if frame[14]>>4 == 6 {
		return fragment6(frame, chunk)
	}
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

func fragment6(frame []byte, chunk int) [][]byte {
	hdr, data := frame[:14+40], frame[14+40:]
	next := hdr[14+6]
	var frags [][]byte
	for off := 0; off < len(data); off += chunk {
		end := min(off+chunk, len(data))
		f := append([]byte(nil), hdr...)
		f[14+6] = 44 // fragment header
		binary.BigEndian.PutUint16(f[14+4:], uint16(8+end-off))
		fo := uint16(off/8) << 3
		if end < len(data) {
			fo |= 1 // more fragments
		}
		f = append(f, next, 0, byte(fo>>8), byte(fo), 0xca, 0xfe, 0x12, 0x34)
		frags = append(frags, append(f, data[off:end]...))
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
	v6 := frags[0][14]>>4 == 6
	hlen, addrs := 20, [2]int{14 + 12, 14 + 20}
	if v6 {
		hlen, addrs = 48, [2]int{14 + 8, 14 + 40}
	}
	out := append([]byte(nil), frags[0][:14+hlen]...)
	for i, f := range frags {
		if err := verifyChecksums(f); err != nil {
			t.Fatalf("fragment %d: %v", i, err)
		}
		if !bytes.Equal(f[addrs[0]:addrs[1]], frags[0][addrs[0]:addrs[1]]) {
			t.Fatalf("fragment %d has addresses %x, fragment 0 %x", i, f[addrs[0]:addrs[1]], frags[0][addrs[0]:addrs[1]])
		}
		out = append(out, f[14+hlen:]...)
	}
	if v6 {
		// Drop the fragment header.
		out[14+6] = out[14+40]
		out = append(out[:14+40], out[14+48:]...)
		binary.BigEndian.PutUint16(out[14+4:], uint16(len(out)-14-40))
		return out
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
// fragment by its ports, the later ones by the datagram id. IPv4 and IPv6 (fragment header).
func TestFragments(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	for _, fam := range families {
		for _, b := range builders(fam.v6) {
			// A TCP segment is not fragmented; an SCTP datagram's CRC covers what its first
			// fragment does not hold, and extension headers after the fragment header hide the
			// protocol of later fragments: TestUntranslatable.
			if b.proto == 6 || b.proto == protoSCTP || b.ext {
				continue
			}
			t.Run(fam.name+"/"+b.name, func(t *testing.T) {
				h.t = t
				podEnd, dst := b.ends(ap(pod(fam.v6, 600), 5300), ap(remote(fam.v6), 53))
				big := bytes.Repeat([]byte("fragmented datagram "), 200) // 4000 bytes
				query := withPayload(b, podEnd, dst, big, true)
				var sent [][]byte
				for i, f := range fragment(query, 1448) {
					out := h.mustPass(h.dp.Egress(), f)
					if got := tupleOfFragment(out).src; got != snatFor(podEnd.Addr()) {
						t.Fatalf("egress fragment %d leaves from %s, want %s", i, got, snatFor(podEnd.Addr()))
					}
					sent = append(sent, out)
				}
				whole := reassemble(t, sent)
				if err := verifyChecksums(whole); err != nil {
					t.Fatalf("reassembled datagram: %v", err)
				}
				nat := tupleOf(t, whole).src

				answer := withPayload(b, dst, nat, bytes.Repeat([]byte("large answer "), 300), false) // 3900 bytes
				var got [][]byte
				for i, f := range fragment(answer, 1448) {
					out := h.mustPass(h.dp.Ingress(), f)
					if d := tupleOfFragment(out).dst; d != podEnd.Addr() {
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
				misses := h.events()[Event(masqEventEV_FRAG_MISS)]
				stray := fragment(withPayload(b, dst, nat, big, false), 1448)[1]
				if fam.v6 {
					stray[14+40+4] ^= 0xff // another datagram id
				} else {
					binary.BigEndian.PutUint16(stray[14+4:], 0x4321)
					stray[14+10], stray[14+11] = 0, 0
					binary.BigEndian.PutUint16(stray[14+10:], ^fold(sum16(stray[14:14+20], 0)))
				}
				if out := h.mustPass(h.dp.Ingress(), stray); !bytes.Equal(out, stray) {
					t.Fatalf("stray fragment rewritten")
				}
				if h.events()[Event(masqEventEV_FRAG_MISS)] != misses+1 {
					t.Fatalf("stray fragment not counted")
				}
			})
		}
	}
}

// tupleOfFragment reads the addresses of any IP packet, fragment or not.
func tupleOfFragment(frame []byte) (addrs struct{ src, dst netip.Addr }) {
	if frame[14]>>4 == 6 {
		addrs.src = netip.AddrFrom16([16]byte(frame[14+8 : 14+24]))
		addrs.dst = netip.AddrFrom16([16]byte(frame[14+24 : 14+40]))
		return addrs
	}
	addrs.src = netip.AddrFrom4([4]byte(frame[14+12 : 14+16]))
	addrs.dst = netip.AddrFrom4([4]byte(frame[14+16 : 14+20]))
	return addrs
}

// withPayload builds the flow's packet (out) or its reply with a given payload.
func withPayload(b builder, src, dst netip.AddrPort, data []byte, out bool) []byte {
	return b.make(src, dst, data, !out)
}

// TestFragMissOnlyWhenFirstUnseen: later fragments of datagrams that need no translation (a pod's
// to a RETURN destination and its answer, the node's own from the uplink address and to it) pass
// untouched without counting frag_miss: every first fragment is remembered, whatever its flow,
// so frag_miss counts only the later fragments whose first fragment was not seen. IPv4 and IPv6.
func TestFragMissOnlyWhenFirstUnseen(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h.t = t
			keep := ap(netip.MustParseAddr("10.2.3.4"), 53)
			if fam.v6 {
				keep = ap(netip.MustParseAddr("fe80::7"), 53) // link-local: left alone by default
			}
			podEnd, node, far := ap(pod(fam.v6, 630), 5330), ap(snatFor(keep.Addr()), 5331), ap(remote(fam.v6), 53)
			big := bytes.Repeat([]byte("needs no NAT "), 400)
			for _, c := range []struct {
				name    string
				ingress bool
				dg      []byte
				ctx     skbContext
			}{
				{"a pod's datagram to a RETURN destination", false, udpPacket(podEnd, keep, big), forwarded},
				{"its answer", true, udpPacket(keep, podEnd, big), forwarded},
				{"the node's datagram from the uplink address", false, udpPacket(node, far, big), skbContext{}},
				{"a datagram to the node's uplink address", true, udpPacket(far, node, big), forwarded},
			} {
				prog := h.dp.Egress()
				if c.ingress {
					prog = h.dp.Ingress()
				}
				before := h.events()[Event(masqEventEV_FRAG_MISS)]
				for i, f := range fragment(c.dg, 1448) {
					ret, out := h.runCtx(t, prog, f, c.ctx)
					if ret != tcNext || !bytes.Equal(out[:len(f)], f) {
						t.Fatalf("%s: fragment %d: verdict %d, changed %v, want it passed untouched", c.name, i, int32(ret), !bytes.Equal(out[:len(f)], f))
					}
				}
				if n := h.events()[Event(masqEventEV_FRAG_MISS)] - before; n != 0 {
					t.Errorf("%s: %d frag_miss counted, want none", c.name, n)
				}
			}
		})
	}
}
