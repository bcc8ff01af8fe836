package bpf

import (
	"bytes"
	"encoding/binary"
	"errors"
	"maps"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
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

				// A later fragment of a datagram whose first fragment was never seen: held when it
				// is for the node (the NAT end), where a mapping may want it; toward a pod
				// (routed on) it needs nothing, and passes as is. Neither is a miss, nor any
				// other event.
				before := h.events()
				stray := withFragID(fragment(withPayload(b, dst, nat, big, false), 1448)[1], 0x4321)
				if ret, _ := h.ingress(stray); ret != tcActShot {
					t.Fatalf("stray fragment for the node: verdict %d, want it held", int32(ret))
				}
				toPod := fragment(withPayload(b, dst, podEnd, big, false), 1448)[1]
				if out := h.mustPass(h.dp.Ingress(), toPod); !bytes.Equal(out, toPod) {
					t.Fatalf("stray fragment toward a pod rewritten")
				}
				if after := h.events(); !maps.Equal(after, before) {
					t.Fatalf("stray fragments counted events: %v, then %v", before, after)
				}
			})
		}
	}
}

// withFragID is a fragment of another datagram: its id set to id.
func withFragID(frag []byte, id uint16) []byte {
	f := append([]byte(nil), frag...)
	if f[14]>>4 == 6 {
		binary.BigEndian.PutUint32(f[14+40+4:], uint32(id))
		return f
	}
	binary.BigEndian.PutUint16(f[14+4:], id)
	f[14+10], f[14+11] = 0, 0
	binary.BigEndian.PutUint16(f[14+10:], ^fold(sum16(f[14:14+20], 0)))
	return f
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
// so frag_miss counts only later fragments that needed their first fragment's flow and could not
// wait for it (TestFragmentHoldBounds). IPv4 and IPv6.
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

// loCapture records the frames lo of the harness's namespace sends (the copies a program sends
// again to the device of BPF_PROG_TEST_RUN, which is lo) or receives.
type loCapture struct {
	h  *harness
	fd int
}

func (h *harness) captureLo(t *testing.T) *loCapture {
	t.Helper()
	c := &loCapture{h: h}
	var err error
	h.ns.do(func() {
		if c.fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL))); err != nil {
			return
		}
		tv := unix.NsecToTimeval(int64(50 * time.Millisecond))
		if err = unix.SetsockoptTimeval(c.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
			return
		}
		err = unix.Bind(c.fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: testIfindex})
	})
	if err != nil {
		t.Fatalf("capture on lo: %v", err)
	}
	t.Cleanup(func() { unix.Close(c.fd) })
	return c
}

// frames returns the frames captured so far that lo sent (outgoing) or received.
func (c *loCapture) frames(t *testing.T, outgoing bool) [][]byte {
	t.Helper()
	var out [][]byte
	buf := make([]byte, 65536)
	for {
		n, from, err := unix.Recvfrom(c.fd, buf, 0)
		if errors.Is(err, unix.EINTR) {
			continue // a receive timeout makes the call one a signal (Go's preemption) ends
		}
		if errors.Is(err, unix.EAGAIN) {
			return out
		}
		if err != nil {
			t.Fatalf("capture on lo: %v", err)
		}
		if ll, ok := from.(*unix.SockaddrLinklayer); ok && (ll.Pkttype == unix.PACKET_OUTGOING) == outgoing {
			out = append(out, append([]byte(nil), buf[:n]...))
		}
	}
}

// TestFragmentsAnyOrder: a datagram whose later fragments arrive before its first is translated
// whole, both ways, IPv4 and IPv6: the later fragments are held (dropped from the hook, their
// bytes kept) until the first comes, which the programs then send to the hook again followed by
// the held ones (here, to lo: the copies are captured and run again, as the hook runs them).
// No fragment of a pod's datagram leaves with the pod's address.
func TestFragmentsAnyOrder(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	capture := h.captureLo(t)
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h.t = t
			podEnd, dst := ap(pod(fam.v6, 610), 5310), ap(remote(fam.v6), 53)
			query := udpPacket(podEnd, dst, bytes.Repeat([]byte("fragmented datagram "), 200))
			sent := h.lastFirst(t, capture, h.dp.Egress(), fragment(query, 1448), true)
			for i, f := range sent {
				if got := tupleOfFragment(f).src; got != snatFor(podEnd.Addr()) {
					t.Fatalf("egress fragment %d leaves from %s, want %s", i, got, snatFor(podEnd.Addr()))
				}
			}
			whole := reassembleAny(t, sent)
			nat := tupleOf(t, whole).src
			answer := udpPacket(dst, nat, bytes.Repeat([]byte("large answer "), 300))
			got := h.lastFirst(t, capture, h.dp.Ingress(), fragment(answer, 1448), false)
			whole = reassembleAny(t, got)
			if tu := tupleOf(t, whole); tu.dst != podEnd || tu.src != dst {
				t.Fatalf("answer arrives as %s, want %s -> %s", tu, dst, podEnd)
			}
		})
	}
}

// lastFirst runs prog on the fragments last first: each later fragment must be held (dropped
// from the hook), and the first one sent again to the hook with the held ones after it (then
// dropped itself). It runs prog on those copies as the hook would, and returns what they became.
func (h *harness) lastFirst(t *testing.T, c *loCapture, prog *ebpf.Program, frags [][]byte, outgoing bool) [][]byte {
	t.Helper()
	c.frames(t, outgoing) // nothing before
	for i := len(frags) - 1; i > 0; i-- {
		if ret, _ := h.run(t, prog, frags[i]); ret != tcActShot {
			t.Fatalf("%s: fragment %d before the first: verdict %d, want it held", prog, i, int32(ret))
		}
	}
	if ret, _ := h.run(t, prog, frags[0]); ret != tcActShot {
		t.Fatalf("%s: the first fragment after the held ones: verdict %d, want its copy sent again", prog, int32(ret))
	}
	again := c.frames(t, outgoing)
	want := append([][]byte{frags[0]}, Reversed(frags[1:])...)
	if len(again) != len(want) {
		t.Fatalf("%s: %d frames sent again, want %d (the first fragment, then the held ones)", prog, len(again), len(want))
	}
	var out [][]byte
	for i, f := range again {
		if !bytes.Equal(f, want[i]) {
			t.Fatalf("%s: frame %d sent again is not fragment %d as it came:\n%s", prog, i, i, describe(f))
		}
		out = append(out, h.mustPass(prog, f)[:len(f)])
	}
	return out
}

// Reversed is frags last first.
func Reversed(frags [][]byte) [][]byte {
	out := make([][]byte, len(frags))
	for i, f := range frags {
		out[len(frags)-1-i] = f
	}
	return out
}

// reassembleAny joins fragments in any order into one Ethernet frame, by their offsets.
func reassembleAny(t *testing.T, frags [][]byte) []byte {
	t.Helper()
	sorted := slices.Clone(frags)
	slices.SortFunc(sorted, func(a, b []byte) int { return fragOffset(a) - fragOffset(b) })
	whole := reassemble(t, sorted)
	if err := verifyChecksums(whole); err != nil {
		t.Fatalf("reassembled datagram: %v", err)
	}
	return whole
}

// fragOffset is a fragment's offset in its datagram, in bytes.
func fragOffset(f []byte) int {
	if f[14]>>4 == 6 {
		return int(binary.BigEndian.Uint16(f[14+40+2:]) &^ 7)
	}
	return int(binary.BigEndian.Uint16(f[14+6:])&0x1fff) * 8
}

// heldCount counts a family's held fragments.
func (h *harness) heldCount(fam policy.Family) int {
	h.t.Helper()
	var n int
	var err error
	if fam == policy.IPv6 {
		n, _, err = scanHeld[masqFrag6HeldKey](h.dp.objs.FragHeldV6, 0, 0)
	} else {
		n, _, err = scanHeld[masqFrag4HeldKey](h.dp.objs.FragHeldV4, 0, 0)
	}
	if err != nil {
		h.t.Fatal(err)
	}
	return n
}

// TestFragmentHoldBounds: the room for held fragments is bounded (8 a family here): a pod's later
// fragment that finds none is dropped as untranslatable (never sent with the pod's address) and
// counted as frag_miss, and an answer's passes untranslated, counted too. The sweep removes
// what waited longer than the kernel's reassembly would (30 s for IPv4, 60 s for IPv6), which
// makes room again.
func TestFragmentHoldBounds(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{FragEntries: 64})
	const room = 8 // heldEntries(64)
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h.t = t
			f := policy.FamilyOf(remote(fam.v6))
			podEnd, dst := ap(pod(fam.v6, 630), 5330), ap(remote(fam.v6), 53)
			later := fragment(udpPacket(podEnd, dst, bytes.Repeat([]byte("held "), 600)), 1448)[1]
			for i := range room {
				if ret, _ := h.egress(withFragID(later, uint16(0x6000+i))); ret != tcActShot {
					t.Fatalf("stray %d: verdict %d, want it held", i, int32(ret))
				}
			}
			if n := h.heldCount(f); n != room {
				t.Fatalf("%d fragments held, want %d", n, room)
			}
			ev := h.events()
			if ret, _ := h.egress(withFragID(later, 0x6100)); ret != tcActShot {
				t.Fatalf("a pod's fragment with no room: verdict %d, want a drop", int32(ret))
			}
			answer := fragment(udpPacket(dst, ap(snatFor(dst.Addr()), 40000), bytes.Repeat([]byte("held "), 600)), 1448)[1]
			if out := h.mustPass(h.dp.Ingress(), answer); !bytes.Equal(out, answer) {
				t.Fatalf("an answer's fragment with no room was rewritten")
			}
			after := h.events()
			if d := after[Event(masqEventEV_DROP_UNTRANSLATABLE)] - ev[Event(masqEventEV_DROP_UNTRANSLATABLE)]; d != 1 {
				t.Errorf("%d untranslatable drops, want 1", d)
			}
			if d := after[Event(masqEventEV_FRAG_MISS)] - ev[Event(masqEventEV_FRAG_MISS)]; d != 2 {
				t.Errorf("%d frag_miss, want 2", d)
			}

			timeout := FragHoldTimeout(f)
			res, err := h.dp.Sweep(MonotonicNow()+timeout-5*time.Second, DefaultTimeouts)
			if err != nil {
				t.Fatal(err)
			}
			if n := h.heldCount(f); n != room {
				t.Fatalf("a sweep before the timeout left %d held fragments, want %d (removed %d)", n, room, res.Fragments)
			}
			if res, err = h.dp.Sweep(MonotonicNow()+timeout+time.Second, DefaultTimeouts); err != nil {
				t.Fatal(err)
			}
			if n := h.heldCount(f); n != 0 || res.Fragments < room {
				t.Fatalf("a sweep after the timeout left %d held fragments (removed %d)", n, res.Fragments)
			}
			if ret, _ := h.egress(withFragID(later, 0x6200)); ret != tcActShot || h.heldCount(f) != 1 {
				t.Fatalf("after the sweep: verdict %d, %d held, want one held", int32(ret), h.heldCount(f))
			}
		})
	}
}
