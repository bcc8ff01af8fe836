package bpf

import (
	"fmt"
	"math/bits"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Held ports: a change of --to-ports must not strand the flows mapped to ports of the ranges in
// force before, as conntrack keeps every binding until its flow ends. The programs look a reply
// up only when its port is one a mapping can hold (bpf/ports.h, port_mapped): a port of the
// ranges, or one of held_ports. So a sync that changes the ranges first holds the ports of the
// ranges it leaves (and, where it cannot tell which ranges the flows in the tables were given,
// every port), and TrimHeldPorts, after each sweep, lets go of those that no flow holds any
// more. New flows never get a held port: they are allocated from nat_ports, the ranges alone.

// portBits is a set of ports, as held_ports holds it: port p is bit p%64 of word p/64.
type portBits [natPortsMax / 64]uint64

// natPortsMax is the number of port numbers (C: NAT_PORTS_MAX).
const natPortsMax = 1 << 16

func (b *portBits) add(p uint16)      { b[p/64] |= 1 << (p % 64) }
func (b *portBits) has(p uint16) bool { return b[p/64]&(1<<(p%64)) != 0 }

func (b *portBits) addRange(r policy.PortRange) {
	for p := int(r.First); p <= int(r.Last); p++ {
		b.add(uint16(p))
	}
}

func (b *portBits) removeRange(r policy.PortRange) {
	for p := int(r.First); p <= int(r.Last); p++ {
		b[p/64] &^= 1 << (p % 64)
	}
}

// count is the number of ports in the set.
func (b *portBits) count() int {
	n := 0
	for _, w := range b {
		n += bits.OnesCount64(w)
	}
	return n
}

// ranges are the set's ports as ranges, in order.
func (b *portBits) ranges() policy.PortRanges {
	var out policy.PortRanges
	for p := 1; p < natPortsMax; p++ {
		if !b.has(uint16(p)) {
			continue
		}
		if n := len(out); n > 0 && int(out[n-1].Last) == p-1 {
			out[n-1].Last = uint16(p)
		} else {
			out = append(out, policy.PortRange{First: uint16(p), Last: uint16(p)})
		}
	}
	return out
}

// HeldPorts are the ports outside the ranges that the programs still look replies up for: those
// of earlier ranges that flows may hold (see TrimHeldPorts).
func (d *Datapath) HeldPorts() policy.PortRanges {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.held.ranges()
}

// holdPorts, before a sync puts next in force, holds the ports of the ranges in force until now
// (every port, when the tables have flows whose ranges are unknown: migrated from an older
// layout's maps) but those of next. d.mu must be held.
func (d *Datapath) holdPorts(next policy.PortRanges) error {
	held := d.held
	if d.ports == nil {
		empty, err := d.natEmpty()
		if err != nil {
			return fmt.Errorf("read nat tables: %w", err)
		}
		if !empty {
			held.addRange(policy.PortRange{First: 1, Last: natPortsMax - 1})
		}
	}
	for _, r := range d.ports {
		held.addRange(r)
	}
	for _, r := range next {
		held.removeRange(r)
	}
	if held != d.held {
		d.heldGen++
	}
	return d.writeHeld(held)
}

// writeHeld writes the words of held_ports that differ from held.
func (d *Datapath) writeHeld(held portBits) error {
	var keys []uint32
	var words []uint64
	for i, w := range held {
		if w != d.held[i] {
			keys, words = append(keys, uint32(i)), append(words, w)
		}
	}
	if err := putAll(d.objs.HeldPorts, keys, words); err != nil {
		return fmt.Errorf("write held_ports: %w", err)
	}
	d.held = held
	return nil
}

// TrimHeldPorts lets go of the held ports (HeldPorts) that no flow holds any more, and returns
// how many stay held. It reads the flow tables only while ports are held: after a change of
// the ranges, until the flows mapped to the old ones have ended. A sync that holds more ports
// meanwhile leaves the trim to the next call.
func (d *Datapath) TrimHeldPorts() (int, error) {
	d.mu.Lock()
	gen, n := d.heldGen, d.held.count()
	d.mu.Unlock()
	if n == 0 {
		return 0, nil
	}
	var used portBits
	for _, fam := range policy.Families() {
		err := d.natTable(fam).entries(func(e NATEntry) bool {
			if p, ok := mappedPort(e); ok {
				used.add(p)
			}
			return true
		})
		if err != nil {
			return n, fmt.Errorf("trim held ports: read %s nat table: %w", fam, err)
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.heldGen != gen {
		return d.held.count(), nil
	}
	held := d.held
	for i := range held {
		held[i] &= used[i]
	}
	if err := d.writeHeld(held); err != nil {
		return d.held.count(), fmt.Errorf("trim held ports: %w", err)
	}
	return held.count(), nil
}

// mappedPort is the port of the node's side that a half of a flow holds, for the flows whose
// replies must be looked up at it: masqueraded ones, and host flows moved off a pod's port.
// Host flows on their own port need no hold: no pod mapping can take a held port, and the
// programs record host flows on held ports only to keep them off a pod's.
func mappedPort(e NATEntry) (uint16, bool) {
	own, mapped := e.To.Port(), e.Dst.Port() // ingress: {remote -> node's side} -> the flow's own side
	if e.Dir == Egress {
		own, mapped = e.Src.Port(), e.To.Port()
	}
	switch {
	case mapped == 0:
		return 0, false // a protocol without ports
	case e.Kind == KindMasq, e.Kind == KindHost && own != mapped:
		return mapped, true
	}
	return 0, false
}
