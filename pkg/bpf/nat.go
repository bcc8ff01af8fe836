package bpf

import (
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

// NATEntries calls fn for every entry of a family's NAT table, until fn returns false. The
// table changes under the walk: an entry added or removed meanwhile may be missed.
func (d *Datapath) NATEntries(fam policy.Family, fn func(NATEntry) bool) error {
	if err := d.natTable(fam).entries(fn); err != nil {
		return fmt.Errorf("read %s nat table: %w", fam, err)
	}
	return nil
}

func (t natTableOf[K]) entries(fn func(NATEntry) bool) error {
	return t.each(func(k K, v *masqNatEntry) bool { return fn(k.tuple().decode(v)) })
}

// NATProtocols counts a family's NAT entries by IP protocol number, without decoding them: what
// a metrics scrape needs, at a few syscalls for a full table.
func (d *Datapath) NATProtocols(fam policy.Family) (map[uint8]uint64, error) {
	var byProto [256]uint64
	if err := d.natTable(fam).protocols(&byProto); err != nil {
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

func (t natTableOf[K]) protocols(byProto *[256]uint64) error {
	return t.each(func(k K, _ *masqNatEntry) bool {
		byProto[k.tuple().proto]++
		return true
	})
}

// LookupNAT returns the entry with the given key, or false.
func (d *Datapath) LookupNAT(dir Direction, proto uint8, src, dst netip.AddrPort) (NATEntry, bool, error) {
	fam := policy.FamilyOf(src.Addr())
	t := keyTuple(dir, proto, src, dst)
	var v masqNatEntry
	if err := d.natMap(fam).Lookup(t.key(), &v); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return NATEntry{}, false, nil
		}
		return NATEntry{}, false, fmt.Errorf("lookup %s nat entry: %w", fam, err)
	}
	return t.decode(&v), true, nil
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
