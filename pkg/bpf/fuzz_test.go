package bpf

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// FuzzPrograms runs packets through the real tc programs (BPF_PROG_TEST_RUN) under a few fixed
// policies: a first packet a on a fresh NAT table, then a second packet b on the state a left.
// dirs bit 0 sends a through ingress instead of egress, bit 1 does the same for b. With bit 2
// (bit 3) b is not taken from the input but made from what a became: its reply (an ICMP error
// about it from its receiver), sent back the other way, so that every mutated flow meets its
// return traffic too. A third packet c, when given, follows (through ingress with bit 4). The
// corpus (f.Add below and testdata/fuzz/FuzzPrograms) starts from valid TCP, UDP, ICMP and
// ICMPv6 flows, their replies and ICMP errors, fragments, other protocols and truncated
// packets; `go test` replays it, `go test -fuzz FuzzPrograms` mutates it. The fuzzer's coverage
// guidance sees the Go side only, so the model below mirrors the programs' branches.
//
// A small model of what the programs parse (fuzzPacket) and of the NAT table as it was before
// each packet predicts the outcome; every packet is checked for:
//   - anything the NAT does not handle (not IP, another protocol, a family the policy leaves
//     alone, a header cut short by the frame or by the IP length, an ingress frame for another
//     MAC) leaves byte for byte as it came;
//   - an egress packet to a RETURN destination with no flow leaves unchanged; a packet of no
//     known flow is rewritten only on egress, only to a masqueraded destination, to the uplink
//     address and a port of the range; a packet of a known flow takes that flow's translation;
//   - a rewritten packet differs only in the address, port and checksum fields the NAT owns, and
//     every checksum (IPv4 header, L4, and those of an ICMP error's quote) is off by exactly as
//     much as it was before: valid stays valid;
//   - a drop is counted under exactly one drop reason and only a drop is; the deciding rule's
//     counter gains exactly this packet; event counters never decrease; NAT entries come in
//     pairs that point at each other; a packet the NAT does not handle creates no entry.
func FuzzPrograms(f *testing.F) {
	pols := fuzzPolicies()
	hs := make([]*harness, len(pols))
	for i, fp := range pols {
		hs[i] = newHarness(f, fp.p, LoadOptions{MaxRules: 64, NATEntries: 4096, FragEntries: 256})
		if fp.noIPv6Addr {
			if _, err := hs[i].dp.SetUplink(testIfindex, Uplink{IPv4: snat4}); err != nil {
				f.Fatal(err)
			}
		}
	}
	for i, fp := range pols {
		for _, s := range fuzzSeeds(fp) {
			f.Add(uint8(i), s.dirs, s.a, s.b, s.c)
		}
	}
	f.Fuzz(func(t *testing.T, pol, dirs uint8, a, b, c []byte) {
		if !runnable(a) || (len(b) > 0 && !runnable(b)) || (len(c) > 0 && !runnable(c)) {
			return
		}
		fz := &fuzzRun{t: t, h: hs[int(pol)%len(hs)], pol: pols[int(pol)%len(pols)]}
		fz.h.t = t
		fz.reset()
		out := fz.step("a", dirs&1 != 0, a, true)
		bIngress := dirs&2 != 0
		switch {
		case dirs&seedReply != 0:
			b, bIngress = replyTo(out), dirs&1 == 0
		case dirs&seedError != 0:
			b, bIngress = errorAbout(out), dirs&1 == 0
		}
		if len(b) > 0 && runnable(b) {
			fz.step("b", bIngress, b, false)
		}
		if len(c) > 0 {
			fz.step("c", dirs&seedCIngress != 0, c, false)
		}
	})
}

// replyTo is the reply to a frame: addresses, ports and MACs swapped, an echo request turned
// into its reply. Swapping keeps the checksums as they were; the echo type's change is
// accounted for. nil for what has no reply.
func replyTo(f []byte) []byte {
	p := parseFuzz(f)
	if p.kind == pktPass || p.kind == pktICMPError {
		return nil
	}
	r := append([]byte(nil), f...)
	copy(r[0:6], macB) // to this host, as replies arrive
	copy(r[6:12], macA)
	src, dst, n := p.addrOff(true), p.addrOff(false), p.addrLen()
	swapBytes(r[src:src+n], r[dst:dst+n])
	switch {
	case p.kind == pktPorts:
		swapBytes(r[p.l4:p.l4+2], r[p.l4+2:p.l4+4])
	case p.kind == pktEcho && p.echoRq:
		typ := map[bool]byte{false: 0, true: 129}[p.v6]
		old := binary.BigEndian.Uint16(r[p.l4:])
		r[p.l4] = typ
		check := binary.BigEndian.Uint16(r[p.l4+2:])
		// RFC 1624: HC' = ~(~HC + ~m + m')
		binary.BigEndian.PutUint16(r[p.l4+2:], ^fold(uint32(^check)+uint32(^old)+uint32(binary.BigEndian.Uint16(r[p.l4:]))))
	}
	return r
}

func swapBytes(a, b []byte) {
	for i := range a {
		a[i], b[i] = b[i], a[i]
	}
}

// errorAbout is an ICMP error (port unreachable) from a frame's receiver back to its sender,
// quoting its IP header and the first 64 bytes after it, as a host or router would.
func errorAbout(f []byte) []byte {
	p := parseFuzz(f)
	if p.kind == pktPass || p.kind == pktICMPError {
		return nil
	}
	typ, code := uint8(3), uint8(3)
	if p.v6 {
		typ, code = 1, 4
	}
	return icmpErrorPacket(p.dst, p.src, typ, code, 0, f[:min(len(f), p.l4+64)])
}

// runnable: BPF_PROG_TEST_RUN refuses frames shorter than Ethernet plus the IP header of their
// EtherType, and frames beyond a page.
func runnable(frame []byte) bool {
	if len(frame) < 14 || len(frame) > 2048 {
		return false
	}
	switch binary.BigEndian.Uint16(frame[12:]) {
	case uint16(layers.EthernetTypeIPv4):
		return len(frame) >= 14+20
	case uint16(layers.EthernetTypeIPv6):
		return len(frame) >= 14+40
	}
	return true
}

type fuzzPolicy struct {
	name string
	p    *policy.Policy
	// port is what the first masqueraded flow from port 40000 gets (fresh table).
	port uint16
	// noIPv6Addr: the uplink has no IPv6 address, so IPv6 flows to masquerade are dropped.
	noIPv6Addr bool
}

// fuzzPolicies: the defaults with IPv6 (ports kept); an IPv4-only list where 198.51.100.0/25 is
// masqueraded, the rest of that /24 is not and nothing is masqueraded by default; a single
// random port (exhaustion at the second flow to a remote); everything RETURN; the defaults on an
// uplink without an IPv6 address.
func fuzzPolicies() []fuzzPolicy {
	v6 := config.Options{EnableIPv6: true}
	list := config.Default(config.Options{})
	list.MasqueradeCIDRs = []config.MasqueradeCIDR{{CIDR: netip.MustParsePrefix("198.51.100.0/25")}, {CIDR: netip.MustParsePrefix("10.9.0.0/16")}}
	list.NonMasqueradeCIDRs = []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("198.51.100.0/24")}
	list.MasqOutBound, list.MasqLinkLocal = false, true
	none := config.Default(v6)
	none.NonMasqueradeCIDRs = []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0"), netip.MustParsePrefix("::/0")}
	return []fuzzPolicy{
		{"defaults", policy.Compile(config.Default(v6), policy.Options{EnableIPv6: true}), 40000, false},
		{"ipv4-list", policy.Compile(list, policy.Options{ToPorts: policy.PortRanges{{First: 1024, Last: 65535}}}), 40000, false},
		{"one-port", policy.Compile(config.Default(v6), policy.Options{EnableIPv6: true, RandomFully: true,
			ToPorts: policy.PortRanges{{First: 5000, Last: 5000}}}), 5000, false},
		{"return-all", policy.Compile(none, policy.Options{EnableIPv6: true}), 0, false},
		{"no-ipv6-address", policy.Compile(config.Default(v6), policy.Options{EnableIPv6: true}), 40000, true},
	}
}

func (fp fuzzPolicy) ports() policy.PortRanges {
	if len(fp.p.ToPorts) > 0 {
		return fp.p.ToPorts
	}
	return policy.PortRanges{policy.DefaultPortRange}
}

func inRanges(rs policy.PortRanges, port uint16) bool {
	return slices.ContainsFunc(rs, func(r policy.PortRange) bool { return port >= r.First && port <= r.Last })
}

// verdict is the chain's first match for a packet of the given family: policy.Decide, except
// that an IPv4-mapped IPv6 destination stays IPv6 here (Decide unmaps it), as it does for the
// datapath and for ip6tables.
func (fp fuzzPolicy) verdict(v6 bool, dst netip.Addr) (policy.Action, *policy.Rule) {
	if !dst.Is4In6() {
		v := fp.p.Decide(dst)
		return v.Action, v.Rule
	}
	rules := fp.p.Rules(policy.IPv6)
	for i := range rules {
		if rules[i].Prefix.Contains(dst) {
			return rules[i].Action, &rules[i]
		}
	}
	return policy.Return, nil
}

func (fp fuzzPolicy) enabled(v6 bool) bool { return !v6 || fp.p.Enabled(policy.IPv6) }

// snat is the uplink's address of the family, if it has one.
func (fp fuzzPolicy) snat(v6 bool) (netip.Addr, bool) {
	if v6 {
		return snat6, !fp.noIPv6Addr
	}
	return snat4, true
}

// The model of what parse() in bpf/parse.h makes of a frame.

const (
	pktPass      = iota // not parsed (not IP, unusable IP header): passes unchanged
	pktPorts            // TCP, UDP, UDP-Lite, DCCP, SCTP
	pktEcho             // ICMP(v6) query or its reply
	pktICMPError        // ICMP(v6) error quoting a packet
	pktLater            // a later fragment: no L4 header
	pktAddr             // a protocol without ports: address-only NAT
	pktUntracked        // an ICMP type conntrack does not track
	pktUnsafe           // untranslatable: L4 header or IPv6 extension headers cut short, too many
)

// Protocol numbers beyond gopacket's names.
const (
	protoDCCP    = 33
	protoSCTP    = 132
	protoUDPLite = 136
)

type fuzzPacket struct {
	kind    int
	v6      bool
	proto   uint8
	l4      int // frame offset of the L4 header
	end     int // frame offset where the IP packet ends: its declared length, bounded by the frame
	first   bool
	fragID  uint32 // raw bytes of the datagram id, as the frag maps key it
	src     netip.Addr
	dst     netip.Addr
	sport   uint16 // source port; a query: the identifier
	dport   uint16 // destination port; a query's reply: the identifier
	flags   uint8  // TCP flags
	echoRq  bool
	transit bool // an IPv6 routing header with segments left
}

// icmpKind is bpf/parse.h's icmp_kind.
func icmpKind(v6 bool, typ uint8) (kind int, request bool) {
	if v6 {
		switch {
		case typ < 128:
			return pktICMPError, false
		case typ == 128 || typ == 139:
			return pktEcho, true
		case typ == 129 || typ == 140:
			return pktEcho, false
		}
		return pktUntracked, false
	}
	switch typ {
	case 8, 13, 15, 17:
		return pktEcho, true
	case 0, 14, 16, 18:
		return pktEcho, false
	case 3, 4, 5, 11, 12:
		return pktICMPError, false
	}
	return pktUntracked, false
}

// ipv6ExtMax is IPV6_EXT_MAX.
const ipv6ExtMax = 8

func parseFuzz(f []byte) fuzzPacket {
	var p fuzzPacket
	if len(f) < 14 {
		return p
	}
	switch binary.BigEndian.Uint16(f[12:]) {
	case uint16(layers.EthernetTypeIPv4):
		if len(f) < 14+20 {
			return p
		}
		ip := f[14:]
		ihl := int(ip[0]&0xf) * 4
		if ip[0]>>4 != 4 || ihl < 20 {
			return p
		}
		// A total length of 0 is what IPv4 BIG TCP sends: the skb says how long it is.
		p.end = len(f)
		if tot := int(binary.BigEndian.Uint16(ip[2:])); tot != 0 {
			if tot < ihl {
				return p
			}
			p.end = min(p.end, 14+tot)
		}
		if 14+ihl > p.end {
			return p // options cut short
		}
		p.proto, p.l4 = ip[9], 14+ihl
		p.src, p.dst = netip.AddrFrom4([4]byte(ip[12:16])), netip.AddrFrom4([4]byte(ip[16:20]))
		p.fragID = uint32(binary.NativeEndian.Uint16(ip[4:6]))
		frag := binary.BigEndian.Uint16(ip[6:])
		if frag&0x1fff != 0 {
			p.kind = pktLater
			return p
		}
		p.first = frag&0x2000 != 0
	case uint16(layers.EthernetTypeIPv6):
		if len(f) < 14+40 {
			return p
		}
		ip := f[14:]
		if ip[0]>>4 != 6 {
			return p
		}
		p.v6 = true
		p.end = len(f)
		if pl := int(binary.BigEndian.Uint16(ip[4:])); pl != 0 {
			p.end = min(p.end, 14+40+pl)
		}
		p.src, p.dst = netip.AddrFrom16([16]byte(ip[8:24])), netip.AddrFrom16([16]byte(ip[24:40]))
		if !p.walk6(f, ip[6], 14+40) {
			p.kind = pktUnsafe
			return p
		}
		if p.kind == pktLater {
			return p
		}
	default:
		return p
	}
	need := map[uint8]int{6: 20, protoSCTP: 12, 17: 8, protoUDPLite: 8, protoDCCP: 8, 1: 8, 58: 8}[p.proto]
	if need == 0 {
		p.kind = pktAddr
		return p
	}
	if p.l4+need > p.end || (p.proto == protoSCTP && p.first) {
		p.kind = pktUnsafe
		return p
	}
	l4 := f[p.l4:p.end]
	switch p.proto {
	case 1, 58:
		if (p.proto == 58) != p.v6 {
			p.kind = pktAddr
			return p
		}
		p.kind, p.echoRq = icmpKind(p.v6, l4[0])
		if p.kind == pktEcho {
			if p.echoRq {
				p.sport = binary.BigEndian.Uint16(l4[4:])
			} else {
				p.dport = binary.BigEndian.Uint16(l4[4:])
			}
		}
		return p
	case 6:
		p.flags = l4[13]
	}
	p.sport, p.dport = binary.BigEndian.Uint16(l4), binary.BigEndian.Uint16(l4[2:])
	p.kind = pktPorts
	return p
}

// walk6 is bpf/parse.h's ipv6_walk: it follows the extension headers from nh at off to the
// upper-layer header; false for an untranslatable chain.
func (p *fuzzPacket) walk6(f []byte, nh uint8, off int) bool {
	ext := func(nh uint8) bool { return slices.Contains([]uint8{0, 43, 60, 51, 44}, nh) }
	for i := 0; i < ipv6ExtMax && ext(nh); i++ {
		if off+8 > p.end {
			return false
		}
		h := f[off:]
		if nh == 44 {
			p.fragID = binary.NativeEndian.Uint32(h[4:8])
			off += 8
			fo := binary.BigEndian.Uint16(h[2:])
			if fo&0xfff8 != 0 {
				p.kind, p.proto, p.l4 = pktLater, h[0], off
				return true
			}
			p.first = fo&1 != 0
			nh = h[0]
			continue
		}
		if nh == 43 && h[3] != 0 {
			p.transit = true
		}
		n := (int(h[1]) + 1) * 8
		if nh == 51 {
			n = (int(h[1]) + 2) * 4
		}
		nh, off = h[0], off+n
	}
	if ext(nh) {
		return false
	}
	p.proto, p.l4 = nh, off
	return true
}

// Offsets of the fields the NAT may write.
func (p fuzzPacket) addrOff(source bool) int {
	switch {
	case p.v6 && source:
		return 14 + 8
	case p.v6:
		return 14 + 24
	case source:
		return 14 + 12
	}
	return 14 + 16
}

func (p fuzzPacket) addrLen() int {
	if p.v6 {
		return 16
	}
	return 4
}

// l4CsumOff is where a protocol's checksum over the NAT's fields lies in its header, and how
// long it is: 0 for none (the checksum of an address-only protocol, if any, covers neither).
func l4CsumOff(proto uint8) (off, n int) {
	switch proto {
	case 6:
		return 16, 2
	case 17, protoUDPLite, protoDCCP:
		return 6, 2
	case 1, 58:
		return 2, 2
	case protoSCTP:
		return 8, 4
	}
	return 0, 0
}

func hasPorts(proto uint8) bool {
	switch proto {
	case 6, 17, protoUDPLite, protoDCCP, protoSCTP, 1, 58:
		return true
	}
	return false
}

func l4PortOff(proto uint8, source bool) int {
	switch {
	case proto == 1 || proto == 58:
		return 4
	case source:
		return 0
	}
	return 2
}

// quote is the packet an ICMP error quotes, as icmp_error() in bpf/icmp.h reads it.
type quote struct {
	off, ihl     int // frame offset of the quoted IP header; its length
	proto        uint8
	src, dst     netip.Addr
	sport, dport uint16
}

func (p fuzzPacket) quote(f []byte) (quote, bool) {
	q := quote{off: p.l4 + 8, ihl: 20}
	if p.v6 {
		q.ihl = 40
	}
	if q.off+q.ihl+8 > p.end {
		return q, false
	}
	b := f[q.off:]
	if p.v6 {
		if b[0]>>4 != 6 {
			return q, false
		}
		q.proto = b[6]
		q.src, q.dst = netip.AddrFrom16([16]byte(b[8:24])), netip.AddrFrom16([16]byte(b[24:40]))
		if slices.Contains([]uint8{0, 43, 44, 60, 51}, q.proto) {
			return q, false // extension headers are not walked in quotes
		}
	} else {
		if b[0] != 0x45 || binary.BigEndian.Uint16(b[6:])&0x1fff != 0 {
			return q, false
		}
		q.proto = b[9]
		q.src, q.dst = netip.AddrFrom4([4]byte(b[12:16])), netip.AddrFrom4([4]byte(b[16:20]))
	}
	l4 := b[q.ihl:]
	switch q.proto {
	case 1, 58:
		if (q.proto == 58) != p.v6 {
			return q, false
		}
		kind, request := icmpKind(p.v6, l4[0])
		if kind != pktEcho {
			return q, false
		}
		if request {
			q.sport = binary.BigEndian.Uint16(l4[4:])
		} else {
			q.dport = binary.BigEndian.Uint16(l4[4:])
		}
	case 6, 17, protoUDPLite, protoDCCP, protoSCTP:
		q.sport, q.dport = binary.BigEndian.Uint16(l4), binary.BigEndian.Uint16(l4[2:])
	}
	return q, true
}

// side is the quoted packet's end that a translation rewrites: the quote went the other way, so
// on ingress its source (the NAT end of a masqueraded flow), on egress its destination.
func (q quote) side(ingress bool) netip.AddrPort {
	if ingress {
		return netip.AddrPortFrom(q.src, q.sport)
	}
	return netip.AddrPortFrom(q.dst, q.dport)
}

// State: the NAT and fragment tables and the counters, read before and after each packet.

type natKeyT struct {
	dir      Direction
	proto    uint8
	src, dst netip.AddrPort
}

type fragKeyT struct {
	dir      Direction
	proto    uint8
	src, dst netip.Addr
	id       uint32
}

type fuzzState struct {
	nat  map[natKeyT]NATEntry
	frag map[fragKeyT][2]uint16 // source and destination port
	held map[fragKeyT]bool      // datagrams with a later fragment held in slot 0 (bpf/frag.h)
	// inbound are the egress keys of the replies that openers toward an address not behind the
	// node wait for (inbound_v4/v6).
	inbound map[natKeyT]bool
	slots   map[uint32][2]uint64 // packets, bytes
	events  map[Event]uint64
}

type fuzzRun struct {
	t   *testing.T
	h   *harness
	pol fuzzPolicy
}

// reset empties the NAT and fragment tables: each input starts from a fresh table, so that it
// replays alone exactly as it ran.
func (fz *fuzzRun) reset() {
	fz.t.Helper()
	for _, fam := range policy.Families() {
		if err := fz.h.dp.deleteAllNAT(fam); err != nil {
			fz.t.Fatal(err)
		}
	}
	if err := emptyMap[masqFrag4Key, masqFragPorts](fz.h.dp.objs.FragV4); err != nil {
		fz.t.Fatal(err)
	}
	if err := emptyMap[masqFrag6Key, masqFragPorts](fz.h.dp.objs.FragV6); err != nil {
		fz.t.Fatal(err)
	}
	for _, err := range []error{
		emptyMap[masqFrag4HeldKey, masqFragHeld](fz.h.dp.objs.FragHeldV4),
		emptyMap[masqFrag6HeldKey, masqFragHeld](fz.h.dp.objs.FragHeldV6),
		emptyMap[masqNat4Key, masqNatEntry](fz.h.dp.objs.InboundV4),
		emptyMap[masqNat6Key, masqNatEntry](fz.h.dp.objs.InboundV6),
	} {
		if err != nil {
			fz.t.Fatal(err)
		}
	}
}

// emptyMap deletes every entry of m.
func emptyMap[K, V any](m *ebpf.Map) error {
	var keys []K
	if err := eachEntry(m, func(k K, _ *V) { keys = append(keys, k) }); err != nil {
		return fmt.Errorf("read %s: %w", m, err)
	}
	if _, err := deleteAll(m, keys); err != nil {
		return fmt.Errorf("delete from %s: %w", m, err)
	}
	return nil
}

func (fz *fuzzRun) state() fuzzState {
	fz.t.Helper()
	s := fuzzState{nat: map[natKeyT]NATEntry{}, frag: map[fragKeyT][2]uint16{}, held: map[fragKeyT]bool{},
		inbound: map[natKeyT]bool{}, slots: map[uint32][2]uint64{}}
	for _, fam := range policy.Families() {
		err := fz.h.dp.NATEntries(fam, func(e NATEntry) bool {
			s.nat[natKeyT{e.Dir, e.Proto, e.Src, e.Dst}] = e
			return true
		})
		if err != nil {
			fz.t.Fatal(err)
		}
	}
	var k4 masqFrag4Key
	var k6 masqFrag6Key
	var v masqFragPorts
	for it := fz.h.dp.objs.FragV4.Iterate(); it.Next(&k4, &v); {
		s.frag[fragKeyT{Direction(k4.Dir), k4.Proto, netip.AddrFrom4(k4.Saddr), netip.AddrFrom4(k4.Daddr), uint32(k4.Id)}] =
			[2]uint16{ntohs(v.Sport), ntohs(v.Dport)}
	}
	for it := fz.h.dp.objs.FragV6.Iterate(); it.Next(&k6, &v); {
		s.frag[fragKeyT{Direction(k6.Dir), k6.Proto, netip.AddrFrom16(k6.Saddr), netip.AddrFrom16(k6.Daddr), k6.Id}] =
			[2]uint16{ntohs(v.Sport), ntohs(v.Dport)}
	}
	var h4 masqFrag4HeldKey
	var h6 masqFrag6HeldKey
	var hv masqFragHeld
	for it := fz.h.dp.objs.FragHeldV4.Iterate(); it.Next(&h4, &hv); {
		if d := h4.Dgram; h4.Slot == 0 {
			s.held[fragKeyT{Direction(d.Dir), d.Proto, netip.AddrFrom4(d.Saddr), netip.AddrFrom4(d.Daddr), uint32(d.Id)}] = true
		}
	}
	for it := fz.h.dp.objs.FragHeldV6.Iterate(); it.Next(&h6, &hv); {
		if d := h6.Dgram; h6.Slot == 0 {
			s.held[fragKeyT{Direction(d.Dir), d.Proto, netip.AddrFrom16(d.Saddr), netip.AddrFrom16(d.Daddr), d.Id}] = true
		}
	}
	var n4 masqNat4Key
	var n6 masqNat6Key
	var ne masqNatEntry
	for it := fz.h.dp.objs.InboundV4.Iterate(); it.Next(&n4, &ne); {
		s.inbound[natKeyT{Egress, n4.Proto, netip.AddrPortFrom(netip.AddrFrom4(n4.Saddr), ntohs(n4.Sport)),
			netip.AddrPortFrom(netip.AddrFrom4(n4.Daddr), ntohs(n4.Dport))}] = true
	}
	for it := fz.h.dp.objs.InboundV6.Iterate(); it.Next(&n6, &ne); {
		s.inbound[natKeyT{Egress, n6.Proto, netip.AddrPortFrom(netip.AddrFrom16(n6.Saddr), ntohs(n6.Sport)),
			netip.AddrPortFrom(netip.AddrFrom16(n6.Daddr), ntohs(n6.Dport))}] = true
	}
	for slot := range fz.h.dp.slots.bySlt {
		packets, bytes, err := fz.h.dp.slotStats(slot)
		if err != nil {
			fz.t.Fatal(err)
		}
		s.slots[slot] = [2]uint64{packets, bytes}
	}
	s.events = fz.h.events()
	return s
}

// expectation is what the model predicts for one packet.
type expectation struct {
	unchanged bool   // every byte stays
	why       string // the reason, for failures
	// When the packet is translated: the side (source on egress, destination on ingress) becomes
	// addr and, when exact, port; otherwise a port of the NAT range (a new mapping).
	addr      netip.Addr
	port      uint16
	exactPort bool
	// newMapping: the packet needs a new mapping, so it gets a port of the range or, when
	// none is free, is dropped (counted as no_port).
	newMapping bool
	// noAddr: the packet needs a new mapping but the uplink has no address of its family: it
	// must be dropped (counted as no_addr).
	noAddr bool
	// noPort: a packet of a protocol without ports needs a mapping another flow holds: it must
	// be dropped (counted as no_port).
	noPort bool
	// untranslatable: a pod's packet the NAT cannot translate, to a masqueraded destination: it
	// must be dropped (counted as untranslatable). No other drop is expected.
	untranslatable bool
	// held: a later fragment whose first fragment was not seen, kept until it comes (bpf/
	// frag.h): dropped from the hook, counted nowhere. released: a first fragment whose
	// datagram had held fragments: its copy and theirs were sent to the hook again, and it is
	// dropped (its bytes are the last held fragment's then).
	held, released bool
	// slot is the counter slot the packet counts on, or noSlot.
	slot uint32
}

func (fz *fuzzRun) slotOf(r *policy.Rule) uint32 {
	if r == nil {
		return noSlot
	}
	// A scan of the synced rules, not slotsByRule's map built for every packet.
	if pl := fz.h.dp.syncedPlan; pl != nil {
		for i, rr := range pl.rules {
			if rr == r {
				return fz.h.dp.syncedSlots[i]
			}
		}
	}
	fz.t.Fatalf("no counter slot for %s", ruleName(r))
	return noSlot
}

func (fz *fuzzRun) expect(p fuzzPacket, frame []byte, ingress bool, pre fuzzState) expectation {
	pass := func(why string) expectation { return expectation{unchanged: true, why: why, slot: noSlot} }
	dir := Egress
	if ingress {
		dir = Ingress
	}
	switch {
	case p.kind == pktPass:
		return pass("not a packet the NAT parses (not IP, unusable IP header)")
	case ingress && !bytes.Equal(frame[:6], macB):
		// The test device's address is macB: any other is another host's (PACKET_OTHERHOST, a
		// macvlan child's), a broadcast's or a multicast's (bpf/scope.h).
		return pass("an ingress frame that is not for this host")
	case !fz.pol.enabled(p.v6):
		return pass("IPv6 is not enabled")
	}
	snat, hasSNAT := fz.pol.snat(p.v6)
	// The datagram's held fragments go first (bpf/frag.h).
	if p.first && pre.held[fragKeyT{dir, p.proto, p.src, p.dst, p.fragID}] {
		return expectation{released: true, why: "first fragment of a datagram with held fragments", slot: noSlot}
	}
	// untranslatable: what the NAT cannot translate passes on ingress; on egress a pod's (every
	// test packet is forwarded, and the test uplink has no MAC to check) to a masqueraded
	// destination is dropped (masq.c's untranslatable); the uplink's own address is a host's.
	untranslatable := func(why string) expectation {
		if ingress {
			return pass(why)
		}
		if hasSNAT && p.src == snat {
			return pass(why + ", from the uplink's address")
		}
		act, rule := fz.pol.verdict(p.v6, p.dst)
		x := expectation{why: why, slot: fz.slotOf(rule)}
		if act == policy.Return {
			x.unchanged, x.why = true, why+", to a RETURN destination"
			return x
		}
		x.untranslatable = true
		return x
	}
	// side is what a translation rewrites: the source on egress, the destination on ingress.
	side := netip.AddrPortFrom(p.src, p.sport)
	if ingress {
		side = netip.AddrPortFrom(p.dst, p.dport)
	}
	// translate: the packet takes the translation of entry e; a flow that is not translated
	// (host, inbound) leaves it as it is. Egress packets of masqueraded flows count on the rule.
	translate := func(e NATEntry, why string, exactPort bool) expectation {
		x := expectation{why: why, addr: e.To.Addr(), port: e.To.Port(), exactPort: exactPort, slot: noSlot}
		if !ingress && e.Kind == KindMasq && p.kind != pktICMPError {
			x.slot = e.Slot
		}
		if e.To.Addr() == side.Addr() && (!exactPort || e.To.Port() == side.Port()) {
			x.unchanged, x.why = true, why+", not translated"
		}
		return x
	}
	switch p.kind {
	case pktUntracked:
		return untranslatable("an ICMP type conntrack does not track")
	case pktUnsafe:
		return untranslatable("untranslatable (cut short, too many extension headers)")
	case pktICMPError:
		q, ok := p.quote(frame)
		if !ok {
			return untranslatable("ICMP error whose quote the NAT cannot read")
		}
		e, ok := pre.nat[natKeyT{dir, q.proto, netip.AddrPortFrom(q.dst, q.dport), netip.AddrPortFrom(q.src, q.sport)}]
		if !ok {
			return untranslatable("ICMP error quoting no flow")
		}
		if e.To == q.side(ingress) {
			return pass("ICMP error quoting a flow that is not translated")
		}
		return translate(e, "ICMP error quoting a translated flow", true)
	case pktLater:
		ports, ok := pre.frag[fragKeyT{dir, p.proto, p.src, p.dst, p.fragID}]
		if !ok {
			// Held when it may need translation: a pod's on egress, one for the node on ingress.
			if (!ingress && !(hasSNAT && p.src == snat)) || (ingress && ((hasSNAT && p.dst == snat) || harnessOwns(p.dst))) {
				return expectation{held: true, why: "later fragment of no known datagram: held", slot: noSlot}
			}
			return untranslatable("later fragment of no known datagram")
		}
		e, ok := pre.nat[natKeyT{dir, p.proto, netip.AddrPortFrom(p.src, ports[0]), netip.AddrPortFrom(p.dst, ports[1])}]
		if !ok {
			return untranslatable("later fragment of a datagram whose flow is gone")
		}
		return translate(e, "later fragment of a known datagram", false) // no L4 header, no port
	}
	if ingress && p.transit {
		return pass("not at its destination yet (routing header)")
	}
	if ingress && hasSNAT && p.dst == snat && p.kind != pktAddr && !inRanges(fz.pol.ports(), p.dport) {
		return pass("to a host port outside the NAT range: not looked up")
	}
	tcpSYN := p.proto == 6 && p.flags&0x16 == 0x02 // SYN without ACK or RST
	act, rule := fz.pol.verdict(p.v6, p.dst)
	key := natKeyT{dir, p.proto, netip.AddrPortFrom(p.src, p.sport), netip.AddrPortFrom(p.dst, p.dport)}
	e, known := pre.nat[key]
	// A closed connection reopened by a SYN keeps its mapping if it is a host's or still
	// masqueraded; any other starts over as a new flow.
	if known && !ingress && tcpSYN && e.Flags&(FlagFIN|FlagRST) != 0 &&
		!(e.Kind == KindHost || (e.Kind == KindMasq && act == policy.Masquerade)) {
		known = false
	}
	if known {
		// An echo request's identifier sits in the source port, a reply's in the destination
		// port: on egress a reply (on ingress a request) is keyed with a port of 0, and its
		// identifier becomes the entry's port only when they differ.
		return translate(e, "packet of a known flow", p.kind != pktEcho || p.echoRq != ingress)
	}
	if ingress {
		return pass("ingress packet of no known flow")
	}
	// held: the remote end's mapping to the uplink address on port toward this remote.
	held := func(port uint16) (NATEntry, bool) {
		e, ok := pre.nat[natKeyT{Ingress, p.proto, netip.AddrPortFrom(p.dst, p.dport), netip.AddrPortFrom(snat, port)}]
		return e, ok
	}
	if hasSNAT && p.src == snat {
		if p.kind == pktEcho && !p.echoRq {
			return pass("host echo reply")
		}
		if p.kind != pktAddr && !inRanges(fz.pol.ports(), p.sport) {
			return pass("host flow on a port outside the NAT range: not recorded")
		}
		// A host flow keeps its port unless a pod mapping (or another host flow's remap) holds
		// it toward this remote; a protocol without ports has no other to take.
		h, ok := held(p.sport)
		if !ok || (h.Kind == KindHost && h.To == netip.AddrPortFrom(snat, p.sport)) {
			return pass("host flow")
		}
		if p.kind == pktAddr {
			return expectation{why: "host flow of a protocol without ports that a pod mapping holds", noPort: true, slot: noSlot}
		}
		return expectation{why: "host flow whose port another mapping holds", addr: snat, newMapping: true, slot: noSlot}
	}
	if p.kind == pktEcho && !p.echoRq {
		return pass("echo reply of no known flow")
	}
	x := expectation{slot: fz.slotOf(rule)}
	if act == policy.Return {
		x.unchanged, x.why = true, "RETURN destination"
		return x
	}
	if !tcpSYN {
		inbound, ok := pre.nat[natKeyT{Ingress, p.proto, netip.AddrPortFrom(p.dst, p.dport), netip.AddrPortFrom(p.src, p.sport)}]
		if ok && inbound.Kind == KindInbound && inbound.To == netip.AddrPortFrom(p.src, p.sport) {
			return pass("reply of an inbound flow whose egress half is gone: restored")
		}
		if pre.inbound[key] && !ok {
			return pass("reply of an opener toward an address the node translated: an inbound flow")
		}
	}
	if p.proto == 6 && !tcpSYN {
		return untranslatable("TCP packet of no known flow that is not a SYN: its state is gone")
	}
	switch {
	case !hasSNAT:
		x.why, x.noAddr = "new flow to a masqueraded destination, no uplink address", true
	case p.kind == pktAddr:
		if _, ok := held(0); ok {
			x.why, x.noPort = "new flow of a protocol without ports, whose mapping to this remote another flow holds", true
		} else {
			x.why, x.addr, x.exactPort = "new flow of a protocol without ports", snat, true
		}
	default:
		x.why, x.addr, x.newMapping = "new flow to a masqueraded destination", snat, true
	}
	return x
}

// step runs one packet, checks it against the model and returns what the program made of it.
func (fz *fuzzRun) step(name string, ingress bool, in []byte, fresh bool) []byte {
	t := fz.t
	t.Helper()
	pre := fz.state()
	p := parseFuzz(in)
	x := fz.expect(p, in, ingress, pre)
	prog, progName := fz.h.dp.Egress(), "egress"
	if ingress {
		prog, progName = fz.h.dp.Ingress(), "ingress"
	}
	ret, out := fz.h.run(t, prog, in)
	post := fz.state()
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf("policy %s, packet %s through %s (%s): %s\nin:\n%s\nout:\n%s", fz.pol.name, name, progName, x.why,
			fmt.Sprintf(format, args...), describe(in), describe(out))
	}

	// Counters.
	drops := 0
	for _, e := range Events() {
		if post.events[e] < pre.events[e] {
			fail("event counter %s went down from %d to %d", e, pre.events[e], post.events[e])
		}
		if isDrop(e) {
			d := post.events[e] - pre.events[e]
			drops += int(d)
			if d > 0 && !(e == EventDropNoPort && (x.newMapping || x.noPort)) && !(e == Event(masqEventEV_DROP_NO_ADDR) && x.noAddr) &&
				!(e == Event(masqEventEV_DROP_UNTRANSLATABLE) && x.untranslatable) {
				fail("dropped for %s (verdict %d)", e, ret)
			}
		}
	}
	switch {
	case (x.held || x.released) && (ret != tcActShot || drops != 0):
		fail("verdict %d with %d drop counts, want it dropped from the hook uncounted", ret, drops)
	case x.held || x.released:
	case x.noAddr && ret != tcActShot:
		fail("passed (verdict %d), want a drop for want of an uplink address", ret)
	case x.noPort && ret != tcActShot:
		fail("passed (verdict %d), want a drop: the mapping is held", ret)
	case x.untranslatable && ret != tcActShot:
		fail("passed (verdict %d), want a drop of an untranslatable packet", ret)
	case ret == tcActShot && drops != 1:
		fail("dropped with %d drop counts", drops)
	case ret == tcNext && drops != 0:
		fail("passed with %d drop counts", drops)
	case ret != tcNext && ret != tcActShot:
		fail("verdict %d", ret)
	}
	for slot, after := range post.slots {
		want := pre.slots[slot]
		if slot == x.slot {
			want[0]++
			want[1] += uint64(len(in) - 14)
		}
		if after != want {
			fail("counter slot %d (%s): packets and bytes %v, want %v (deciding slot %d)", slot,
				fz.h.dp.slots.bySlt[slot].prefix(), after, want, x.slot)
		}
	}
	checkPairs(post, fail)
	newMasq := 0
	for k, e := range post.nat {
		if _, ok := pre.nat[k]; !ok && k.dir == Egress && e.Kind == KindMasq {
			newMasq++
		}
	}
	if d := post.events[Event(masqEventEV_NEW_MASQ)] - pre.events[Event(masqEventEV_NEW_MASQ)]; d != uint64(newMasq) {
		fail("new_masq counted %d, %d masquerade mappings created", d, newMasq)
	}
	if p.kind == pktPass || p.kind == pktUnsafe || p.kind == pktUntracked || !fz.pol.enabled(p.v6) {
		if len(post.nat) != len(pre.nat) {
			fail("a packet the NAT does not handle changed the NAT table from %d to %d entries", len(pre.nat), len(post.nat))
		}
	}

	if x.held || x.released {
		if len(post.nat) != len(pre.nat) {
			fail("a fragment held or sent again changed the NAT table from %d to %d entries", len(pre.nat), len(post.nat))
		}
		return out
	}
	// Bytes.
	if len(out) != len(in) {
		fail("length %d became %d", len(in), len(out))
	}
	if ret == tcActShot {
		return out
	}
	if x.unchanged {
		if !bytes.Equal(in, out) {
			fail("changed bytes %v", diffOffsets(in, out))
		}
		return out
	}
	if fresh && ingress {
		fail("the model expects ingress to translate on a fresh table")
	}
	if bytes.Equal(in, out) {
		fail("not translated")
	}
	allowed := p.writable(in, ingress)
	for _, off := range diffOffsets(in, out) {
		if !allowed[off] {
			fail("byte %d changed (%#02x -> %#02x): not a field the NAT owns; changed %v", off, in[off], out[off], diffOffsets(in, out))
		}
	}
	if err := sameResiduals(p, in, out); err != nil {
		fail("%v", err)
	}
	// The translated side.
	o := parseFuzz(out)
	var got netip.AddrPort
	switch p.kind {
	case pktICMPError:
		q, _ := o.quote(out)
		got = q.side(ingress)
		// The outer address is the flow's own only when it was the quoted one.
		qin, _ := p.quote(in)
		outer, outerOut := p.src, o.src
		if ingress {
			outer, outerOut = p.dst, o.dst
		}
		if want := map[bool]netip.Addr{true: x.addr, false: outer}[outer == qin.side(ingress).Addr()]; outerOut != want {
			fail("outer address %s became %s, want %s", outer, outerOut, want)
		}
	default:
		got = netip.AddrPortFrom(o.src, o.sport)
		if ingress {
			got = netip.AddrPortFrom(o.dst, o.dport)
		}
		if p.kind == pktEcho && !p.echoRq {
			got = netip.AddrPortFrom(got.Addr(), o.dport)
		}
	}
	if got.Addr() != x.addr {
		fail("translated to address %s, want %s", got.Addr(), x.addr)
	}
	switch {
	case x.exactPort && got.Port() != x.port:
		fail("translated to port %d, want %d", got.Port(), x.port)
	case x.newMapping:
		// A new mapping: a port of the range, the pod's own on a fresh table unless random.
		if !inRanges(fz.pol.ports(), got.Port()) {
			fail("new mapping on port %d, outside %s", got.Port(), fz.pol.ports())
		}
		if fresh && !fz.pol.p.RandomFully && inRanges(fz.pol.ports(), p.sport) && got.Port() != p.sport {
			fail("port %d not kept on a fresh table without --random-fully: got %d", p.sport, got.Port())
		}
	}
	return out
}

// checkPairs: every NAT entry's partner exists and points back at it.
func checkPairs(s fuzzState, fail func(string, ...any)) {
	for k, e := range s.nat {
		ps, pd := partnerKey(e)
		pdir := Ingress
		if k.dir == Ingress {
			pdir = Egress
		}
		partner, ok := s.nat[natKeyT{pdir, k.proto, ps, pd}]
		if !ok {
			fail("NAT entry %s %s -> %s (to %s, %s) has no partner", k.dir, k.src, k.dst, e.To, e.Kind)
		}
		if !pointsBack(e, partner) {
			fail("NAT entry %s %s -> %s (to %s) and its partner (to %s) disagree", k.dir, k.src, k.dst, e.To, partner.To)
		}
	}
}

func diffOffsets(a, b []byte) []int {
	var out []int
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			out = append(out, i)
		}
	}
	return out
}

// writable is the set of frame offsets a translation of p may change: the translated side's
// address and port, the checksums that cover them and, for an ICMP error, the same in its quote.
func (p fuzzPacket) writable(f []byte, ingress bool) map[int]bool {
	w := map[int]bool{}
	span := func(off, n int) {
		for i := off; i < off+n; i++ {
			w[i] = true
		}
	}
	source := !ingress
	span(p.addrOff(source), p.addrLen())
	if !p.v6 {
		span(14+10, 2)
	}
	switch p.kind {
	case pktPorts, pktEcho:
		span(p.l4+l4PortOff(p.proto, source), 2)
		co, cn := l4CsumOff(p.proto)
		span(p.l4+co, cn)
	case pktICMPError:
		span(p.l4+2, 2)
		q, _ := p.quote(f)
		// The quoted packet went the other way: on ingress its source is the translated side.
		qsource := ingress
		aoff := map[[2]bool]int{{false, true}: 12, {false, false}: 16, {true, true}: 8, {true, false}: 24}[[2]bool{p.v6, qsource}]
		span(q.off+aoff, p.addrLen())
		if !p.v6 {
			span(q.off+10, 2)
		}
		if hasPorts(q.proto) {
			span(q.off+q.ihl+l4PortOff(q.proto, qsource), 2)
			co, cn := l4CsumOff(q.proto)
			span(q.off+q.ihl+co, cn)
		}
	}
	return w
}

// residual is the one's complement sum of everything a checksum covers, checksum included: 0
// (in one's complement, where 0xffff is 0 too) when the checksum is valid. An incremental
// update keeps it as it was, valid or not.
func residual(s uint32) uint16 { return fold(s) % 0xffff }

// sameResiduals checks that the rewrite kept every checksum exactly as (in)valid as it was.
func sameResiduals(p fuzzPacket, in, out []byte) error {
	type sum struct {
		name string
		of   func(f []byte) (uint32, bool)
	}
	pseudo := func(f []byte, src, dst int, n int, proto uint8) uint32 {
		return pseudoSum(f[src:src+n], f[dst:dst+n], proto, 0)
	}
	sums := []sum{}
	if !p.v6 {
		sums = append(sums, sum{"IPv4 header", func(f []byte) (uint32, bool) { return uint32(residual(sum16(f[14:p.l4], 0))), true }})
	}
	// l4sum is the residual of the L4 checksum of the header at l4 (end: where its packet ends),
	// false for none: a zero UDP checksum, or a protocol without one over the NAT's fields.
	l4sum := func(f []byte, l4, end, src, dst int, proto uint8, v6 bool) (uint32, bool) {
		switch proto {
		case protoSCTP:
			return crc32cResidual(f[l4:end]), true
		case 17:
			if binary.BigEndian.Uint16(f[l4+6:]) == 0 {
				return 0, false // no UDP checksum: must stay none, compared below
			}
		case 6, protoUDPLite, protoDCCP, 1, 58:
		default:
			return 0, false
		}
		s := sum16(f[l4:], 0)
		if proto != 1 {
			s += pseudo(f, src, dst, map[bool]int{false: 4, true: 16}[v6], proto)
		}
		return uint32(residual(s)), true
	}
	switch p.kind {
	case pktPorts, pktEcho, pktICMPError:
		sums = append(sums, sum{"L4", func(f []byte) (uint32, bool) {
			return l4sum(f, p.l4, p.end, p.addrOff(true), p.addrOff(false), p.proto, p.v6)
		}})
	}
	if p.kind == pktICMPError {
		q, _ := p.quote(in)
		if !p.v6 {
			sums = append(sums, sum{"quoted IPv4 header", func(f []byte) (uint32, bool) {
				return uint32(residual(sum16(f[q.off:q.off+20], 0))), true
			}})
		}
		// The quote's L4 checksum covers bytes that are not there; the ones that are must
		// keep their part of the sum. A TCP checksum and an SCTP CRC lie past the 8 bytes every
		// quote has, and are updated only when the IP packet holds them.
		if need := map[uint8]int{6: 20, protoSCTP: 12}[q.proto]; q.off+q.ihl+need <= p.end {
			qsrc, qdst := q.off+12, q.off+16
			if p.v6 {
				qsrc, qdst = q.off+8, q.off+24
			}
			sums = append(sums, sum{"quoted L4", func(f []byte) (uint32, bool) {
				return l4sum(f, q.off+q.ihl, p.end, qsrc, qdst, q.proto, p.v6)
			}})
		}
	}
	for _, s := range sums {
		a, aok := s.of(in)
		b, bok := s.of(out)
		if aok != bok || a != b {
			return fmt.Errorf("%s checksum: residual %#04x (present %v) became %#04x (present %v)", s.name, a, aok, b, bok)
		}
	}
	return nil
}

// crc32cResidual is an SCTP packet's computed CRC32c XOR the one it carries: 0 when valid, and
// what an incremental update keeps.
func crc32cResidual(sctp []byte) uint32 {
	b := append([]byte(nil), sctp...)
	stored := binary.LittleEndian.Uint32(b[8:12])
	copy(b[8:12], []byte{0, 0, 0, 0})
	return crc32.Checksum(b, crc32.MakeTable(crc32.Castagnoli)) ^ stored
}

// Seeds.

type fuzzSeed struct {
	dirs    uint8
	a, b, c []byte
}

const (
	seedAEgress  = 0
	seedAIngress = 1
	seedBIngress = 2
	seedReply    = 4 // b is a's reply
	seedError    = 8 // b is an ICMP error about a
	seedCIngress = 16
)

func fuzzSeeds(fp fuzzPolicy) []fuzzSeed {
	var seeds []fuzzSeed
	add := func(dirs uint8, a, b []byte) { seeds = append(seeds, fuzzSeed{dirs, a, b, nil}) }
	add3 := func(dirs uint8, a, b, c []byte) { seeds = append(seeds, fuzzSeed{dirs, a, b, c}) }
	router := map[bool]netip.Addr{false: netip.MustParseAddr("203.0.113.9"), true: netip.MustParseAddr("2001:db8:eeee::9")}
	for _, v6 := range []bool{false, true} {
		podEnd, dst := ap(pod(v6, 1), 40000), ap(remote(v6), 443)
		snat := snatFor(podEnd.Addr())
		nat := ap(snat, fp.port)
		for _, b := range builders(v6) {
			pe, de := b.ends(podEnd, dst)
			out := b.out(pe, de)
			translated := append([]byte(nil), out...)
			if fp.port != 0 {
				translated = b.out(nat, de)
			}
			reply := b.back(de, nat)
			add(seedAEgress, out, out)                                          // the flow's next packet
			add(seedAEgress|seedBIngress, out, reply)                           // its reply
			add(seedAEgress|seedBIngress, out, b.back(de, ap(snat, fp.port+1))) // a reply to another port
			typ, code := uint8(3), uint8(3)
			if v6 {
				typ, code = 1, 4
			}
			add(seedAEgress|seedBIngress, out, icmpErrorPacket(router[v6], snat, typ, code, 0, translated))
			// From outside toward the pod: the inbound flow, the pod's reply, its ICMP error.
			in := b.out(de, pe)
			add(seedAIngress, in, b.back(pe, de))
			add(seedAIngress, in, icmpErrorPacket(pe.Addr(), de.Addr(), typ, code, 0, in))
			add(seedAEgress, b.back(pe, de), nil) // an echo reply or a reply of no flow
			// The same with the return traffic made from what the programs output.
			add(seedAEgress|seedReply, out, nil)
			add(seedAEgress|seedError, out, nil)
			add(seedAIngress|seedReply, in, nil)
			add(seedAIngress|seedError, in, nil)
		}
		// Host flows, and a host socket on a port a pod mapping holds.
		add(seedAEgress, tcpPacket(ap(snat, 40001), dst, tcpSYN, nil), nil)
		add(seedAEgress, tcpPacket(podEnd, dst, tcpSYN, nil), tcpPacket(ap(snat, fp.port), dst, tcpSYN, nil))
		// A second pod on the same port to the same remote (exhaustion with one port).
		add(seedAEgress, udpPacket(podEnd, dst, payload), udpPacket(ap(pod(v6, 2), 40000), dst, payload))
		// Destinations the policies treat differently: RFC 1918, link-local, the /25 edge.
		for _, d := range []string{"10.2.3.4", "169.254.1.1", "198.51.100.200", "8.8.8.8", "fd00::1", "fe80::1", "::ffff:10.0.0.1", "2600::1"} {
			a := netip.MustParseAddr(d)
			if a.Is6() == v6 {
				add(seedAEgress, udpPacket(podEnd, ap(a, 53), payload), nil)
			}
		}
		// Fragments: the first then a later one, both ways.
		big := bytes.Repeat([]byte("fragmented datagram "), 40)
		frags := fragment(udpPacket(podEnd, ap(remote(v6), 53), big), 256)
		add(seedAEgress, frags[0], frags[1])
		rfrags := fragment(udpPacket(ap(remote(v6), 53), nat, big), 256)
		add(seedAEgress|seedBIngress, udpPacket(podEnd, ap(remote(v6), 53), payload), rfrags[0])
		add(seedAEgress|seedBIngress, frags[0], rfrags[1])
		add(seedAEgress|seedReply, frags[0], nil)
		add(seedAEgress|seedError, frags[0], nil)
		add(seedAEgress|seedReply, frags[1], nil)
		// Fragments in any order: a later one before the first, both ways (bpf/frag.h).
		add(seedAEgress, frags[1], frags[0])
		add3(seedAEgress|seedBIngress|seedCIngress, udpPacket(podEnd, ap(remote(v6), 53), payload), rfrags[1], rfrags[0])
		// A connection from outside to a Service address routed back out the uplink (203.0.113.0/24
		// and 2001:db8:7777::/48 in the harness), which the node's stack DNATs to a pod: its reply.
		svc := ap(serviceAddr(v6), 80)
		add(seedAIngress, tcpPacket(dst, svc, tcpSYN, nil), tcpPacket(svc, dst, tcpSYN|tcpACK, nil))
		add(seedAIngress, udpPacket(dst, svc, payload), udpPacket(svc, dst, payload))
		// A reply too big for one packet: its first fragment, then a later one, both ingress.
		add3(seedAEgress|seedBIngress|seedCIngress, udpPacket(podEnd, ap(remote(v6), 53), payload), rfrags[0], rfrags[1])
		add3(seedAEgress|seedBIngress|seedCIngress, udpPacket(podEnd, ap(remote(v6), 53), payload), rfrags[0], rfrags[0])
		// A flow, its reply, then its next packet (established both ways).
		tcpOut := tcpPacket(podEnd, dst, tcpSYN, nil)
		add3(seedAEgress|seedBIngress, tcpOut, tcpPacket(dst, nat, tcpSYN|tcpACK, nil), tcpPacket(podEnd, dst, tcpACK, nil))
		add3(seedAEgress|seedBIngress|seedCIngress, tcpOut, tcpPacket(dst, nat, tcpRST, nil), tcpPacket(dst, nat, tcpACK, nil))
		// Cut short: by the frame, and by the IP length over Ethernet padding.
		tcp := tcpPacket(podEnd, dst, tcpSYN, nil)
		udp := udpPacket(podEnd, dst, nil)
		ihl := 20
		if v6 {
			ihl = 40
		}
		add(seedAEgress, tcp[:14+ihl+12], nil)
		add(seedAEgress, udp[:14+ihl+6], nil)
		add(seedAEgress, withIPLength(udp, ihl+4), nil)
		add(seedAEgress, withIPLength(tcp, ihl+8), nil)
		add(seedAEgress|seedBIngress, udp, withIPLength(udpPacket(dst, nat, nil), ihl+4))
		add(seedAEgress|seedBIngress, udp, icmpErrorPacket(router[v6], snat, 3, 3, 0, udp)[:14+ihl+8+10])
		add(seedAEgress|seedBIngress, udp, withIPLength(icmpErrorPacket(router[v6], snat, 3, 3, 0, udpPacket(nat, dst, nil)), ihl+8+ihl))
	}
	// Untranslatable, or not for the NAT at all.
	src4, dst4 := ap(pod4(9), 40000), ap(remote4, 80)
	src6, dst6 := ap(pod6(9), 40000), ap(remote6, 80)
	arp := serializeRaw(&layers.Ethernet{SrcMAC: macA, DstMAC: macB, EthernetType: layers.EthernetTypeARP},
		&layers.ARP{AddrType: layers.LinkTypeEthernet, Protocol: layers.EthernetTypeIPv4, HwAddressSize: 6,
			ProtAddressSize: 4, Operation: 1, SourceHwAddress: macA, SourceProtAddress: []byte{10, 1, 0, 9},
			DstHwAddress: make([]byte, 6), DstProtAddress: []byte{10, 1, 0, 1}})
	for _, frame := range [][]byte{
		arp,
		withIHL(tcpPacket(src4, dst4, tcpSYN, nil)[:14+20], 15),
		serialize(src4.Addr(), dst4.Addr(), layers.IPProtocolGRE, gopacket.Payload(make([]byte, 24))),
		serialize(src6.Addr(), dst6.Addr(), layers.IPProtocolSCTP, gopacket.Payload(make([]byte, 24))),
		serialize(src6.Addr(), dst6.Addr(), layers.IPProtocolIPv6HopByHop, gopacket.Payload([]byte{6, 0, 1, 4, 0, 0, 0, 0})),
		serialize(src4.Addr(), dst4.Addr(), layers.IPProtocolICMPv4,
			&layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(layers.ICMPv4TypeTimestampRequest, 0)}, gopacket.Payload(make([]byte, 12))),
		serialize(src6.Addr(), netip.MustParseAddr("ff02::1:ff00:1"), layers.IPProtocolICMPv6,
			&layers.ICMPv6{TypeCode: layers.CreateICMPv6TypeCode(layers.ICMPv6TypeNeighborSolicitation, 0)}, gopacket.Payload(make([]byte, 20))),
		icmpQuery(src4.Addr(), dst4.Addr(), 10, 0, nil),
		nExt6(udpPacket(src6, dst6, payload), ipv6ExtMax+1),
		nExt6(udpPacket(src6, dst6, payload), ipv6ExtMax),
		withIPLength(nExt6(udpPacket(src6, dst6, payload), 3), 40+20),
		fragment(sctpPacket(src4, dst4, bytes.Repeat(payload, 20)), 256)[0],
		withExt6(fragment(udpPacket(src6, dst6, bytes.Repeat(payload, 20)), 256)[1], 60),
	} {
		add(seedAEgress, frame, nil)
		add(seedAIngress, frame, nil)
	}
	return seeds
}

// withIPLength sets the IP packet's declared length (IPv4 total length, IPv6 payload length
// plus the fixed header) to n bytes, leaving the frame as long as it was: the rest is padding,
// as Ethernet adds to short frames.
func withIPLength(frame []byte, n int) []byte {
	f := append([]byte(nil), frame...)
	if f[14]>>4 == 6 {
		binary.BigEndian.PutUint16(f[14+4:], uint16(n-40))
		return f
	}
	binary.BigEndian.PutUint16(f[14+2:], uint16(n))
	f[14+10], f[14+11] = 0, 0
	binary.BigEndian.PutUint16(f[14+10:], ^fold(sum16(f[14:14+20], 0)))
	return f
}

// harnessOwns tells whether the FIB of the harness's namespace (which has no address but lo's)
// takes addr for the node's own, as the programs' node_owns asks it: loopback, and IPv6 multicast
// (its local routes).
func harnessOwns(a netip.Addr) bool {
	return a.IsLoopback() || (a.Is6() && a.IsMulticast())
}
