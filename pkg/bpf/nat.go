package bpf

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Direction says which half of a flow an entry is.
type Direction uint8

const (
	// Egress entries match packets leaving through the uplink by their original tuple.
	Egress = Direction(masqNatDirDIR_EGRESS)
	// Ingress entries match the replies as they arrive.
	Ingress = Direction(masqNatDirDIR_INGRESS)
)

func (d Direction) String() string {
	if d == Ingress {
		return "ingress"
	}
	return "egress"
}

// Kind is the kind of flow an entry belongs to.
type Kind uint8

const (
	// KindMasq is a masqueraded pod flow.
	KindMasq = Kind(masqNatKindNAT_MASQ)
	// KindHost is a host socket's flow on the uplink address: it reserves its port, and is
	// translated only when a pod mapping held that port first.
	KindHost = Kind(masqNatKindNAT_HOST)
	// KindInbound is a connection opened from outside toward a pod: never translated.
	KindInbound = Kind(masqNatKindNAT_INBOUND)
)

func (k Kind) String() string {
	switch k {
	case KindMasq:
		return "masq"
	case KindHost:
		return "host"
	case KindInbound:
		return "inbound"
	}
	return fmt.Sprintf("kind_%d", uint8(k))
}

// Flags record what went through an entry's direction.
type Flags uint8

const (
	FlagSeen = Flags(masqNatFlagsNAT_F_SEEN) // a packet went this way (both ways: established)
	FlagFIN  = Flags(masqNatFlagsNAT_F_FIN)
	FlagRST  = Flags(masqNatFlagsNAT_F_RST)
)

// NATEntry is one half of a flow, as the NAT table holds it.
type NATEntry struct {
	Dir   Direction
	Proto uint8
	// Src and Dst are the key: the tuple of the packets this entry matches. For ICMP echo the
	// identifier is the request's source port and the reply's destination port.
	Src, Dst netip.AddrPort
	// To is the translation: the new source of egress packets, the new destination of ingress
	// packets. It equals the key's side for untranslated (host, inbound) flows.
	To    netip.AddrPort
	Kind  Kind
	Flags Flags
	Slot  uint32 // counter slot of the deciding rule (masqueraded egress entries)
	// LastSeen is CLOCK_MONOTONIC time (see MonotonicNow), refreshed at most once a second.
	LastSeen time.Duration
}

// PartnerKey is the other half's key: (src, dst) of the flow's entry in the other direction.
func (e NATEntry) PartnerKey() (src, dst netip.AddrPort) {
	if e.Dir == Egress {
		return e.Dst, e.To
	}
	return e.To, e.Src
}

// MonotonicNow is the clock of NATEntry.LastSeen (bpf_ktime_get_ns).
func MonotonicNow() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		panic(fmt.Sprintf("clock_gettime(CLOCK_MONOTONIC): %v", err)) // cannot fail on Linux
	}
	return time.Duration(ts.Nano())
}

func (d *Datapath) natMap(fam policy.Family) *ebpf.Map {
	if fam == policy.IPv6 {
		return d.objs.NatV6
	}
	return d.objs.NatV4
}

func decode4(k masqNat4Key, v masqNatEntry) NATEntry {
	return decodeEntry(false, Direction(k.Dir), k.Proto, [4]uint32{k.Saddr}, [4]uint32{k.Daddr}, k.Sport, k.Dport, v)
}

func decode6(k masqNat6Key, v masqNatEntry) NATEntry {
	return decodeEntry(true, Direction(k.Dir), k.Proto, k.Saddr, k.Daddr, k.Sport, k.Dport, v)
}

func decodeEntry(v6 bool, dir Direction, proto uint8, s, d [4]uint32, sp, dp uint16, v masqNatEntry) NATEntry {
	return NATEntry{
		Dir: dir, Proto: proto,
		Src:  netip.AddrPortFrom(wordsAddr(v6, s), ntohs(sp)),
		Dst:  netip.AddrPortFrom(wordsAddr(v6, d), ntohs(dp)),
		To:   netip.AddrPortFrom(wordsAddr(v6, v.Addr), ntohs(v.Port)),
		Kind: Kind(v.Kind), Flags: Flags(v.Flags), Slot: v.Slot,
		LastSeen: time.Duration(v.LastSeen),
	}
}

// natKey is the map key of an entry's (dir, proto, src, dst).
func natKey(dir Direction, proto uint8, src, dst netip.AddrPort) any {
	if src.Addr().Is4() {
		return masqNat4Key{Saddr: addr4Word(src.Addr()), Daddr: addr4Word(dst.Addr()),
			Sport: htons(src.Port()), Dport: htons(dst.Port()), Proto: proto, Dir: masqNatDir(dir)}
	}
	return masqNat6Key{Saddr: addr6Words(src.Addr()), Daddr: addr6Words(dst.Addr()),
		Sport: htons(src.Port()), Dport: htons(dst.Port()), Proto: proto, Dir: masqNatDir(dir)}
}

// natBatch is how many entries one batch lookup reads: a full default table (262144 entries)
// is then 64 syscalls, and the buffers stay a few hundred KiB.
const natBatch = 4096

// walkNAT calls fn with the entries of a NAT table a batch at a time, until fn returns false:
// keys[:n] and vals[:n] hold the batch, valid only during the call. It reads with
// BPF_MAP_LOOKUP_BATCH, bucket by bucket, so that a table the programs change meanwhile is
// still walked once (an entry added or removed during the walk may be missed); kernels without
// batch operations are walked key by key.
func walkNAT[K any](m *ebpf.Map, fn func(keys []K, vals []masqNatEntry, n int) bool) error {
	keys, vals := make([]K, natBatch), make([]masqNatEntry, natBatch)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		if errors.Is(err, ebpf.ErrNotSupported) {
			return walkNATByKey(m, keys, vals, fn)
		}
		done := errors.Is(err, ebpf.ErrKeyNotExist)
		if err != nil && !done {
			return err
		}
		if n > 0 && !fn(keys, vals, n) {
			return nil
		}
		if done {
			return nil
		}
	}
}

// walkNATByKey is walkNAT with one syscall per key, for kernels before 5.6.
func walkNATByKey[K any](m *ebpf.Map, keys []K, vals []masqNatEntry, fn func(keys []K, vals []masqNatEntry, n int) bool) error {
	it := m.Iterate()
	n := 0
	for it.Next(&keys[n], &vals[n]) {
		if n++; n == len(keys) {
			if !fn(keys, vals, n) {
				return nil
			}
			n = 0
		}
	}
	if err := it.Err(); err != nil {
		return err
	}
	if n > 0 {
		fn(keys, vals, n)
	}
	return nil
}

// NATEntries calls fn for every entry of a family's NAT table, until fn returns false. The
// table changes under the walk: an entry added or removed meanwhile may be missed.
func (d *Datapath) NATEntries(fam policy.Family, fn func(NATEntry) bool) error {
	var err error
	if fam == policy.IPv6 {
		err = walkNAT(d.objs.NatV6, func(keys []masqNat6Key, vals []masqNatEntry, n int) bool {
			for i := range n {
				if !fn(decode6(keys[i], vals[i])) {
					return false
				}
			}
			return true
		})
	} else {
		err = walkNAT(d.objs.NatV4, func(keys []masqNat4Key, vals []masqNatEntry, n int) bool {
			for i := range n {
				if !fn(decode4(keys[i], vals[i])) {
					return false
				}
			}
			return true
		})
	}
	if err != nil {
		return fmt.Errorf("read %s nat table: %w", fam, err)
	}
	return nil
}

// NATProtocols counts a family's NAT entries by IP protocol number, without decoding them: what
// a metrics scrape needs, at a few syscalls for a full table.
func (d *Datapath) NATProtocols(fam policy.Family) (map[uint8]uint64, error) {
	var byProto [256]uint64
	var err error
	if fam == policy.IPv6 {
		err = walkNAT(d.objs.NatV6, func(keys []masqNat6Key, _ []masqNatEntry, n int) bool {
			for _, k := range keys[:n] {
				byProto[k.Proto]++
			}
			return true
		})
	} else {
		err = walkNAT(d.objs.NatV4, func(keys []masqNat4Key, _ []masqNatEntry, n int) bool {
			for _, k := range keys[:n] {
				byProto[k.Proto]++
			}
			return true
		})
	}
	if err != nil {
		return nil, fmt.Errorf("read %s nat table: %w", fam, err)
	}
	out := map[uint8]uint64{}
	for proto, n := range byProto {
		if n > 0 {
			out[uint8(proto)] = n
		}
	}
	return out, nil
}

// LookupNAT returns the entry with the given key, or false.
func (d *Datapath) LookupNAT(dir Direction, proto uint8, src, dst netip.AddrPort) (NATEntry, bool, error) {
	fam := policy.FamilyOf(src.Addr())
	var v masqNatEntry
	k := natKey(dir, proto, src, dst)
	if err := d.natMap(fam).Lookup(k, &v); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return NATEntry{}, false, nil
		}
		return NATEntry{}, false, fmt.Errorf("lookup %s nat entry: %w", fam, err)
	}
	if fam == policy.IPv6 {
		return decode6(k.(masqNat6Key), v), true, nil
	}
	return decode4(k.(masqNat4Key), v), true, nil
}

// deleteEntries deletes entries by key; entries already gone are fine.
func (d *Datapath) deleteEntries(fam policy.Family, entries []NATEntry) error {
	m := d.natMap(fam)
	for _, e := range entries {
		err := m.Delete(natKey(e.Dir, e.Proto, e.Src, e.Dst))
		if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("delete %s nat entry: %w", fam, err)
		}
	}
	return nil
}

// Timeouts say how long an idle flow is kept, by protocol and state.
type Timeouts struct {
	// TCPEstablished: both directions seen, no FIN or RST.
	TCPEstablished time.Duration
	// TCPOpening: only one direction seen yet (e.g. a SYN with no answer).
	TCPOpening time.Duration
	// TCPClosing: a FIN or RST seen. Long enough that a pod reusing its port after TIME_WAIT
	// still finds its mapping (and the far side sees the same port again).
	TCPClosing time.Duration
	UDP        time.Duration
	ICMP       time.Duration
	// Other covers any protocol number the datapath may learn later.
	Other time.Duration
}

// DefaultTimeouts are conntrack-like.
var DefaultTimeouts = Timeouts{
	TCPEstablished: 6 * time.Hour,
	TCPOpening:     2 * time.Minute,
	TCPClosing:     2 * time.Minute,
	UDP:            2 * time.Minute,
	ICMP:           30 * time.Second,
	Other:          2 * time.Minute,
}

// FlowState is what a flow's two halves have seen.
type FlowState uint8

const (
	// StateUnreplied: packets went one way only so far.
	StateUnreplied FlowState = iota
	// StateEstablished: packets went both ways.
	StateEstablished
	// StateClosing: a TCP FIN or RST went either way.
	StateClosing
)

func (s FlowState) String() string {
	switch s {
	case StateEstablished:
		return "established"
	case StateClosing:
		return "closing"
	}
	return "unreplied"
}

// stateOf combines the flags of a flow's halves; partner is nil when the other half is gone.
func stateOf(e NATEntry, partner *NATEntry) FlowState {
	flags := e.Flags
	both := false
	if partner != nil {
		flags |= partner.Flags
		both = e.Flags&FlagSeen != 0 && partner.Flags&FlagSeen != 0
	}
	switch {
	case flags&(FlagFIN|FlagRST) != 0:
		return StateClosing
	case both:
		return StateEstablished
	}
	return StateUnreplied
}

// Flow is both halves of a flow.
type Flow struct {
	Egress NATEntry
	// Ingress is the other half; Partial tells that it is missing (evicted, or taken over).
	Ingress NATEntry
	Partial bool
	State   FlowState
}

// Flows calls fn for every flow of a family, from its egress half (one lookup per flow for the
// ingress half), until fn returns false. Ingress halves without an egress half are not seen.
func (d *Datapath) Flows(fam policy.Family, fn func(Flow) bool) error {
	var inner error
	err := d.NATEntries(fam, func(e NATEntry) bool {
		if e.Dir != Egress {
			return true
		}
		s, dst := e.PartnerKey()
		p, ok, err := d.LookupNAT(Ingress, e.Proto, s, dst)
		if err != nil {
			inner = err
			return false
		}
		f := Flow{Egress: e}
		if ok && pointsBack(e, p) {
			f.Ingress, f.State = p, stateOf(e, &p)
		} else {
			f.Partial, f.State = true, stateOf(e, nil)
		}
		return fn(f)
	})
	return cmp.Or(inner, err)
}

// timeout is how long a flow in a state may be idle.
func (t Timeouts) timeout(proto uint8, state FlowState) time.Duration {
	switch proto {
	case unix.IPPROTO_TCP:
		switch state {
		case StateClosing:
			return t.TCPClosing
		case StateEstablished:
			return t.TCPEstablished
		default:
			return t.TCPOpening
		}
	case unix.IPPROTO_UDP:
		return t.UDP
	case unix.IPPROTO_ICMP, unix.IPPROTO_ICMPV6:
		return t.ICMP
	}
	return t.Other
}

// shortest is the least time a flow of the protocol is kept idle, whatever its state: an entry
// seen more recently cannot expire, and the sweep does not look at it further.
func (t Timeouts) shortest(proto uint8) time.Duration {
	if proto == unix.IPPROTO_TCP {
		return min(t.TCPEstablished, t.TCPOpening, t.TCPClosing)
	}
	return t.timeout(proto, StateUnreplied)
}

// SweepResult counts what a sweep removed.
type SweepResult struct {
	Flows   int // flows whose both halves were removed
	Orphans int // halves whose partner was gone or belonged to another flow
}

// Sweep removes the flows idle for longer than their timeout at time now (MonotonicNow), both
// halves together. A flow's state and idle time combine its two halves; a half without its
// partner (evicted, or its key taken over) expires by its own.
//
// It reads the table in batches and looks further only at entries idle for longer than their
// protocol's shortest timeout: a sweep of a busy table costs a few syscalls per batch and no
// memory per entry. An expired flow costs two lookups (its partner, and itself again in case a
// packet refreshed it since the batch was read); entries are deleted a batch at a time.
//
// The entries it removes are added, by protocol, to the totals that SweptEntries reads (kept in
// a map, so that they survive an agent restart); the totals assume one sweeper at a time.
func (d *Datapath) Sweep(now time.Duration, t Timeouts) (res SweepResult, err error) {
	swept := map[uint8]uint64{}
	defer func() {
		if serr := d.addSwept(swept); serr != nil && err == nil {
			err = fmt.Errorf("sweep: %w", serr)
		}
	}()
	if err := sweepTable[masqNat4Key](d.objs.NatV4, now, t, &res, swept); err != nil {
		return res, fmt.Errorf("sweep: %w", err)
	}
	if err := sweepTable[masqNat6Key](d.objs.NatV6, now, t, &res, swept); err != nil {
		return res, fmt.Errorf("sweep: %w", err)
	}
	return res, nil
}

// rawNATKey is a NAT table key as the map holds it (masqNat4Key, masqNat6Key), with what the
// sweep needs of it without decoding.
type rawNATKey[K any] interface {
	comparable
	direction() Direction
	protocol() uint8
	// partner is the key of the other half of the flow, given this half's value.
	partner(v *masqNatEntry) K
	// pointedBy tells whether v, the value found under partner(), is the other half of this
	// entry's flow rather than of a flow that took its key over (pointsBack).
	pointedBy(v *masqNatEntry) bool
}

func (k masqNat4Key) direction() Direction { return Direction(k.Dir) }
func (k masqNat4Key) protocol() uint8      { return k.Proto }
func (k masqNat6Key) direction() Direction { return Direction(k.Dir) }
func (k masqNat6Key) protocol() uint8      { return k.Proto }

func (k masqNat4Key) partner(v *masqNatEntry) masqNat4Key {
	if k.direction() == Egress {
		return masqNat4Key{Saddr: k.Daddr, Daddr: v.Addr[0], Sport: k.Dport, Dport: v.Port, Proto: k.Proto, Dir: masqNatDir(Ingress)}
	}
	return masqNat4Key{Saddr: v.Addr[0], Daddr: k.Saddr, Sport: v.Port, Dport: k.Sport, Proto: k.Proto, Dir: masqNatDir(Egress)}
}

func (k masqNat6Key) partner(v *masqNatEntry) masqNat6Key {
	if k.direction() == Egress {
		return masqNat6Key{Saddr: k.Daddr, Daddr: v.Addr, Sport: k.Dport, Dport: v.Port, Proto: k.Proto, Dir: masqNatDir(Ingress)}
	}
	return masqNat6Key{Saddr: v.Addr, Daddr: k.Saddr, Sport: v.Port, Dport: k.Sport, Proto: k.Proto, Dir: masqNatDir(Egress)}
}

func (k masqNat4Key) pointedBy(v *masqNatEntry) bool {
	if k.direction() == Egress {
		return v.Addr[0] == k.Saddr && v.Port == k.Sport
	}
	return v.Addr[0] == k.Daddr && v.Port == k.Dport
}

func (k masqNat6Key) pointedBy(v *masqNatEntry) bool {
	if k.direction() == Egress {
		return v.Addr == k.Saddr && v.Port == k.Sport
	}
	return v.Addr == k.Daddr && v.Port == k.Dport
}

// rawState is stateOf for raw values; partner is nil when the other half is gone.
func rawState(v, partner *masqNatEntry) FlowState {
	e := NATEntry{Flags: Flags(v.Flags)}
	if partner == nil {
		return stateOf(e, nil)
	}
	return stateOf(e, &NATEntry{Flags: Flags(partner.Flags)})
}

// sweepTable is Sweep on one NAT table.
func sweepTable[K rawNATKey[K]](m *ebpf.Map, now time.Duration, t Timeouts, res *SweepResult, swept map[uint8]uint64) error {
	var (
		doomed []K
		sizes  []int // per expired flow or orphan half: how many keys of doomed it has (2 or 1)
		inner  error
	)
	err := walkNAT(m, func(keys []K, vals []masqNatEntry, n int) bool {
		doomed, sizes = doomed[:0], sizes[:0]
		for i := range n {
			// k is a copy; lookups take &keys[i], which is on the heap already.
			k, v := keys[i], &vals[i]
			if now-time.Duration(v.LastSeen) <= t.shortest(k.protocol()) {
				continue
			}
			pk := k.partner(v)
			var pv masqNatEntry
			err := m.Lookup(&pk, &pv)
			if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				inner = fmt.Errorf("lookup nat entry: %w", err)
				return false
			}
			paired := err == nil && k.pointedBy(&pv)
			if paired {
				if k.direction() != Egress {
					continue // a flow is judged once, from its egress half
				}
				last := time.Duration(max(v.LastSeen, pv.LastSeen))
				if now-last <= t.timeout(k.protocol(), rawState(v, &pv)) {
					continue
				}
			} else if now-time.Duration(v.LastSeen) <= t.timeout(k.protocol(), rawState(v, nil)) {
				continue
			}
			// A packet may have refreshed the entry since its batch was read.
			if touched, err := touchedSince(m, &keys[i], v.LastSeen); err != nil {
				inner = err
				return false
			} else if touched {
				continue
			}
			doomed = append(doomed, k)
			if paired {
				doomed = append(doomed, pk)
				sizes = append(sizes, 2)
			} else {
				sizes = append(sizes, 1)
			}
		}
		gone, err := deleteKeys(m, doomed)
		if err != nil {
			inner = err
			return false
		}
		at := 0
		for _, size := range sizes {
			deleted := 0
			for j := at; j < at+size; j++ {
				if gone[j] {
					deleted++
					swept[doomed[j].protocol()]++
				}
			}
			at += size
			if size == 2 && deleted == 2 {
				res.Flows++
			} else {
				res.Orphans += deleted
			}
		}
		return true
	})
	return cmp.Or(inner, err)
}

// deleteKeys deletes keys from a NAT table, a batch at a time where the kernel can, and tells
// which it deleted: a key that is gone already (an LRU eviction, another CPU) is skipped.
func deleteKeys[K any](m *ebpf.Map, keys []K) ([]bool, error) {
	gone := make([]bool, len(keys))
	for at := 0; at < len(keys); {
		n, err := m.BatchDelete(keys[at:], nil)
		if errors.Is(err, ebpf.ErrNotSupported) {
			for i := at; i < len(keys); i++ {
				err := m.Delete(&keys[i])
				if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
					return nil, fmt.Errorf("delete nat entry: %w", err)
				}
				gone[i] = err == nil
			}
			return gone, nil
		}
		for i := at; i < at+n; i++ {
			gone[i] = true
		}
		at += n
		switch {
		case err == nil:
		case errors.Is(err, ebpf.ErrKeyNotExist):
			at++ // keys[at] is gone already: go on after it
		default:
			return nil, fmt.Errorf("delete nat entries: %w", err)
		}
	}
	return gone, nil
}

// addSwept adds removed entries by protocol to sweep_stats.
func (d *Datapath) addSwept(swept map[uint8]uint64) error {
	for proto, n := range swept {
		if n == 0 {
			continue
		}
		var total uint64
		if err := d.objs.SweepStats.Lookup(uint32(proto), &total); err != nil {
			return fmt.Errorf("read sweep_stats[%d]: %w", proto, err)
		}
		if err := d.objs.SweepStats.Put(uint32(proto), total+n); err != nil {
			return fmt.Errorf("write sweep_stats[%d]: %w", proto, err)
		}
	}
	return nil
}

// SweptEntries returns how many NAT entries sweeps removed, by IP protocol number, since the
// maps were created. Protocols without removals are left out.
func (d *Datapath) SweptEntries() (map[uint8]uint64, error) {
	out := map[uint8]uint64{}
	var (
		proto uint32
		n     uint64
	)
	it := d.objs.SweepStats.Iterate()
	for it.Next(&proto, &n) {
		if n > 0 {
			out[uint8(proto)] = n
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read sweep_stats: %w", err)
	}
	return out, nil
}

// touchedSince reports whether the entry at key changed since it was read with lastSeen: a
// packet refreshed it, or it is gone. The sweep asks before deleting an idle flow.
func touchedSince(m *ebpf.Map, key any, lastSeen uint64) (bool, error) {
	var cur masqNatEntry
	if err := m.Lookup(key, &cur); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return true, nil
		}
		return false, fmt.Errorf("lookup nat entry: %w", err)
	}
	return cur.LastSeen != lastSeen, nil
}

// pointsBack tells whether partner is the other half of e's flow rather than of a flow that
// took its key over (the BPF side's points_back).
func pointsBack(e, partner NATEntry) bool {
	if e.Dir == Egress {
		return partner.To == e.Src
	}
	return partner.To == e.Dst
}

// FlushAddr removes every flow translated to or from addr (an uplink's previous SNAT address):
// masqueraded and host flows whose translated source is addr, with both halves.
func (d *Datapath) FlushAddr(addr netip.Addr) (int, error) {
	addr = addr.Unmap()
	fam := policy.FamilyOf(addr)
	var doomed []NATEntry
	if err := d.NATEntries(fam, func(e NATEntry) bool {
		switch {
		case e.Kind == KindInbound:
		case e.Dir == Egress && e.To.Addr() == addr:
			doomed = append(doomed, e)
		case e.Dir == Ingress && e.Dst.Addr() == addr:
			doomed = append(doomed, e)
		}
		return true
	}); err != nil {
		return 0, fmt.Errorf("flush %s: %w", addr, err)
	}
	if err := d.deleteEntries(fam, doomed); err != nil {
		return 0, fmt.Errorf("flush %s: %w", addr, err)
	}
	return len(doomed), nil
}

// Uplink is the SNAT addresses of an uplink device; an invalid (zero) address means none of
// that family, and masquerading packets of that family on the device are dropped.
type Uplink struct {
	IPv4, IPv6 netip.Addr
}

// SetUplink sets the SNAT addresses of the device with ifindex. When an address changes, the
// flows translated to the old one are flushed (they could not get replies any more); the
// number of entries removed is returned.
func (d *Datapath) SetUplink(ifindex int, u Uplink) (int, error) {
	if u.IPv4.IsValid() && !u.IPv4.Unmap().Is4() {
		return 0, fmt.Errorf("set uplink %d: %s is not an IPv4 address", ifindex, u.IPv4)
	}
	if u.IPv6.IsValid() && (!u.IPv6.Is6() || u.IPv6.Is4In6()) {
		return 0, fmt.Errorf("set uplink %d: %s is not an IPv6 address", ifindex, u.IPv6)
	}
	old, _, err := d.Uplink(ifindex)
	if err != nil {
		return 0, err
	}
	var v masqUplink
	if u.IPv4.IsValid() {
		v.V4, v.HasV4 = addr4Word(u.IPv4.Unmap()), 1
	}
	if u.IPv6.IsValid() {
		v.V6, v.HasV6 = addr6Words(u.IPv6), 1
	}
	if err := d.objs.UplinkSnat.Put(uint32(ifindex), &v); err != nil {
		return 0, fmt.Errorf("set uplink %d: write uplink_snat: %w", ifindex, err)
	}
	return d.flushChanged(old, u)
}

// RemoveUplink forgets a device and flushes the flows translated to its addresses.
func (d *Datapath) RemoveUplink(ifindex int) (int, error) {
	old, ok, err := d.Uplink(ifindex)
	if err != nil || !ok {
		return 0, err
	}
	if err := d.objs.UplinkSnat.Delete(uint32(ifindex)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return 0, fmt.Errorf("remove uplink %d: %w", ifindex, err)
	}
	return d.flushChanged(old, Uplink{})
}

func (d *Datapath) flushChanged(old, cur Uplink) (int, error) {
	n := 0
	for _, pair := range [][2]netip.Addr{{old.IPv4, cur.IPv4}, {old.IPv6, cur.IPv6}} {
		if pair[0].IsValid() && pair[0] != pair[1] {
			m, err := d.FlushAddr(pair[0])
			n += m
			if err != nil {
				return n, err
			}
		}
	}
	return n, nil
}

// Uplink reads the SNAT addresses of a device.
func (d *Datapath) Uplink(ifindex int) (Uplink, bool, error) {
	var v masqUplink
	if err := d.objs.UplinkSnat.Lookup(uint32(ifindex), &v); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return Uplink{}, false, nil
		}
		return Uplink{}, false, fmt.Errorf("read uplink %d: %w", ifindex, err)
	}
	var u Uplink
	if v.HasV4 != 0 {
		u.IPv4 = word4Addr(v.V4)
	}
	if v.HasV6 != 0 {
		u.IPv6 = words6Addr(v.V6)
	}
	return u, true, nil
}
