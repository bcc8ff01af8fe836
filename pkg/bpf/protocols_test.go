package bpf

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"testing"

	"github.com/gopacket/gopacket/layers"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Every IP protocol is masqueraded (TestRoundTrip runs every builder); these tests cover what
// the builders do not: untranslatable packets, protocols without ports sharing a remote, SCTP's
// CRC over every length, and IPv6 extension headers.

// nExt6 puts n destination options headers before a frame's L4 header.
func nExt6(frame []byte, n int) []byte {
	kinds := make([]uint8, n)
	for i := range kinds {
		kinds[i] = 60
	}
	return withExt6(frame, kinds...)
}

// TestUntranslatable: a pod's packet the NAT cannot translate, to a masqueraded destination,
// is dropped and counted rather than sent with the pod's address, and opens nothing; the same
// packet sent by the node itself (no ingress device) passes as it is.
func TestUntranslatable(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	for _, fam := range families {
		src, dst := ap(pod(fam.v6, 9), 40000), ap(remote(fam.v6), 80)
		ihl := 20
		if fam.v6 {
			ihl = 40
		}
		tcp := tcpPacket(src, dst, tcpSYN, nil)
		udp := udpPacket(src, dst, payload)
		untracked := icmpQuery(src.Addr(), dst.Addr(), 10, 0, nil) // router solicitation
		errType := uint8(3)
		if fam.v6 {
			untracked = icmpQuery(src.Addr(), dst.Addr(), 133, 0, nil)
			errType = 1
		}
		big := bytes.Repeat([]byte("fragmented datagram "), 40)
		// A later fragment whose first fragment was dropped (untranslatable): its datagram is
		// known, its flow is not. One that comes before its first fragment is held instead
		// (TestFragmentsAnyOrder).
		sctpFrags := fragment(sctpPacket(ap(src.Addr(), 40001), dst, big), 256)
		later := sctpFrags[1]
		cases := map[string][]byte{
			"tcp header cut by the frame":       tcp[:14+ihl+12],
			"udp header cut by the frame":       udp[:14+ihl+6],
			"tcp header cut by the IP length":   withIPLength(tcp, ihl+8),
			"an ICMP type conntrack ignores":    untracked,
			"ICMP error quoting no flow":        icmpErrorPacket(src.Addr(), dst.Addr(), errType, 3, 0, udpPacket(dst, ap(src.Addr(), 999), nil)),
			"ICMP error with a short quote":     icmpErrorPacket(src.Addr(), dst.Addr(), errType, 3, 0, udp)[:14+ihl+8+10],
			"later fragment of a dropped first": later,
			"first fragment of SCTP":            fragment(sctpPacket(src, dst, big), 256)[0],
			"SCTP header cut by the IP length":  withIPLength(sctpPacket(src, dst, nil), ihl+10),
		}
		if fam.v6 {
			cases["more extension headers than walked"] = nExt6(udp, ipv6ExtMax+1)
			cases["extension header cut short"] = withIPLength(nExt6(udp, 2), 40+12)
			cases["ICMPv6 error quoting extension headers"] = icmpErrorPacket(src.Addr(), dst.Addr(), 1, 4, 0, nExt6(udpPacket(dst, ap(src.Addr(), 999), nil), 1))
		} else {
			cases["ICMP error quoting IPv4 options"] = icmpErrorPacket(src.Addr(), dst.Addr(), 3, 3, 0, withIHL(udpPacket(dst, src, nil), 6))
		}
		for name, frame := range cases {
			t.Run(fam.name+"/"+name, func(t *testing.T) {
				h.t = t
				if p := parseFuzz(frame); p.kind == pktPorts {
					t.Fatalf("the model parses it as translatable: %+v", p)
				}
				if name == "later fragment of a dropped first" {
					if ret, _ := h.egress(sctpFrags[0]); ret != tcActShot {
						t.Fatalf("the SCTP first fragment: verdict %d, want a drop", int32(ret))
					}
				}
				before := h.events()[Event(masqEventEV_DROP_UNTRANSLATABLE)]
				if ret, _ := h.egress(frame); ret != tcActShot {
					t.Fatalf("a pod's: verdict %d, want a drop", int32(ret))
				}
				if d := h.events()[Event(masqEventEV_DROP_UNTRANSLATABLE)] - before; d != 1 {
					t.Fatalf("counted %d untranslatable drops, want 1", d)
				}
				if ret, out := runCtx(t, h.dp.Egress(), frame, skbContext{}); ret != tcNext || !bytes.Equal(out[:len(frame)], frame) {
					t.Fatalf("the node's own: verdict %d, changed %v", int32(ret), !bytes.Equal(out[:len(frame)], frame))
				}
			})
		}
	}
	for _, fam := range policy.Families() {
		n := 0
		if err := h.dp.NATEntries(fam, func(NATEntry) bool { n++; return true }); err != nil {
			t.Fatal(err)
		}
		if n != 0 {
			t.Fatalf("%s: %d NAT entries from untranslatable packets", fam, n)
		}
	}
}

// TestAddressOnlyClash: a protocol without ports has one mapping per remote, as conntrack's
// generic tracking: a second pod's flow of the same protocol to the same remote is dropped (as
// conntrack drops the clash) until the first one's mapping is gone; to another remote, or of
// another protocol, it has its own; the node's own flow of that protocol to that remote is
// dropped too while a pod holds it. Replies go to the pod that holds the mapping.
func TestAddressOnlyClash(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h.t = t
			gre := func(src, dst netip.Addr) []byte {
				return rawPacket(src, dst, layers.IPProtocolGRE, append([]byte{0, 0, 0x08, 0x00}, payload...))
			}
			pod1, pod2, r, r2 := pod(fam.v6, 21), pod(fam.v6, 22), remote(fam.v6), remote(fam.v6).Next()
			snat := snatFor(r)
			if got := tupleOf(t, h.mustPass(h.dp.Egress(), gre(pod1, r))).src.Addr(); got != snat {
				t.Fatalf("first pod's GRE leaves from %s", got)
			}
			drops := h.events()[EventDropNoPort]
			if ret, _ := h.egress(gre(pod2, r)); ret != tcActShot || h.events()[EventDropNoPort] != drops+1 {
				t.Fatalf("second pod's GRE to the same remote: verdict %d, no_port drops %d, want a drop", int32(ret), h.events()[EventDropNoPort]-drops)
			}
			if ret, _ := h.egress(gre(snat, r)); ret != tcActShot {
				t.Fatalf("the node's own GRE to a remote a pod holds: verdict %d, want a drop", int32(ret))
			}
			if got := tupleOf(t, h.mustPass(h.dp.Egress(), gre(pod2, r2))).src.Addr(); got != snat {
				t.Fatalf("second pod's GRE to another remote leaves from %s", got)
			}
			esp := rawPacket(pod2, r, layers.IPProtocolESP, append([]byte{0, 0, 0, 1, 0, 0, 0, 1}, payload...))
			if got := tupleOf(t, h.mustPass(h.dp.Egress(), esp)).src.Addr(); got != snat {
				t.Fatalf("second pod's ESP to the first's remote leaves from %s", got)
			}
			if got := tupleOf(t, h.mustPass(h.dp.Ingress(), gre(r, snat))).dst.Addr(); got != pod1 {
				t.Fatalf("the reply goes to %s, want the first pod %s", got, pod1)
			}
			// The first pod's mapping ends (the sweep): the second pod gets it.
			e, ok, err := h.dp.LookupNAT(Egress, uint8(layers.IPProtocolGRE), ap(pod1, 0), ap(r, 0))
			if err != nil || !ok {
				t.Fatalf("no mapping of the first pod: %v", err)
			}
			if err := h.dp.deleteEntries(policy.FamilyOf(r), []NATEntry{e}); err != nil {
				t.Fatal(err)
			}
			s, d := partnerKey(e)
			pe, ok, _ := h.dp.LookupNAT(Ingress, uint8(layers.IPProtocolGRE), s, d)
			if ok {
				if err := h.dp.deleteEntries(policy.FamilyOf(r), []NATEntry{pe}); err != nil {
					t.Fatal(err)
				}
			}
			h.mustPass(h.dp.Egress(), gre(pod2, r))
			if got := tupleOf(t, h.mustPass(h.dp.Ingress(), gre(r, snat))).dst.Addr(); got != pod2 {
				t.Fatalf("after the first mapping ended the reply goes to %s, want the second pod %s", got, pod2)
			}
		})
	}
}

// TestSCTPCRC: a port rewrite keeps an SCTP packet's CRC32c valid whatever its length (the
// update multiplies by x^(8 length) bit by bit of the length), both ways.
func TestSCTPCRC(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	for _, fam := range families {
		for i, n := range []int{0, 1, 4, 37, 255, 256, 1000, 1400} {
			t.Run(fmt.Sprintf("%s/%d", fam.name, n), func(t *testing.T) {
				h.t = t
				data := bytes.Repeat([]byte{byte(n)}, n)
				in := sctpPacket(ap(pod(fam.v6, 30+i), 5000), ap(remote(fam.v6), 36412), data)
				out := h.mustPass(h.dp.Egress(), in) // checks the CRC
				got := tupleOf(t, out)
				if got.src.Port() == 5000 {
					t.Fatalf("port kept under --random-fully: the CRC update is not exercised")
				}
				back := h.mustPass(h.dp.Ingress(), sctpPacket(got.dst, got.src, data))
				if rt := tupleOf(t, back); rt.dst != ap(pod(fam.v6, 30+i), 5000) {
					t.Fatalf("reply arrives for %s", rt.dst)
				}
			})
		}
	}
}

// TestIPv6ExtensionHeaders: packets behind hop-by-hop, routing, destination options and AH
// headers, up to IPV6_EXT_MAX of them, are translated as the kernel walks them; a routing header
// with segments left keeps a reply untranslated (the packet is not at its destination yet).
func TestIPv6ExtensionHeaders(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	src, dst := ap(pod6(40), 7000), ap(remote6, 53)
	ah := func(frame []byte) []byte {
		// An AH header of 16 bytes (length 2: (2+2)*4), after the fixed header.
		f := append(append(append([]byte(nil), frame[:14+40]...), frame[14+6], 2, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0), frame[14+40:]...)
		f[14+6] = 51
		binary.BigEndian.PutUint16(f[14+4:], binary.BigEndian.Uint16(f[14+4:])+16)
		return f
	}
	for name, in := range map[string][]byte{
		"the most extension headers walked": nExt6(udpPacket(src, dst, payload), ipv6ExtMax),
		"AH":                                ah(udpPacket(ap(src.Addr(), 7001), dst, payload)),
		"fragment header after options":     withExt6(fragment(udpPacket(ap(src.Addr(), 7002), dst, bytes.Repeat(payload, 20)), 256)[0], 60),
	} {
		t.Run(name, func(t *testing.T) {
			h.t = t
			out := h.mustPass(h.dp.Egress(), in)
			if got := tupleOf(t, out).src.Addr(); got != snat6 {
				t.Fatalf("leaves from %s", got)
			}
		})
	}
	t.Run("routing header with segments left", func(t *testing.T) {
		h.t = t
		out := h.mustPass(h.dp.Egress(), udpPacket(ap(src.Addr(), 7003), dst, payload))
		reply := withExt6(udpPacket(dst, tupleOf(t, out).src, payload), 43)
		reply[14+40+3] = 1 // one segment left
		if back := h.mustPass(h.dp.Ingress(), reply); !bytes.Equal(back, reply) {
			t.Fatalf("a packet not at its destination yet was translated to %s", tupleOf(t, back).dst)
		}
		reply[14+40+3] = 0
		if got := tupleOf(t, h.mustPass(h.dp.Ingress(), reply)).dst; got != ap(src.Addr(), 7003) {
			t.Fatalf("with no segments left the reply arrives for %s", got)
		}
	})
}
