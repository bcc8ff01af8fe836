package bpf

import (
	"errors"
	"fmt"
	"strings"

	"github.com/cilium/ebpf"
)

// Event is a reason the datapath counts (drops among them), summed over CPUs by EventCounts.
// The one list of events is enum event in bpf/types.h; an event's name is its enumerator's,
// without EV_ and in lower case (stringer over the constants bpf2go writes, see gen.go), and
// the events that count dropped packets are the EV_DROP_* ones.
type Event uint32

// The events userspace tells apart; Events lists every one.
const (
	EventPortRetry   = Event(masqEventEV_PORT_RETRY)   // port claims that found the port taken
	EventDropNoPort  = Event(masqEventEV_DROP_NO_PORT) // dropped: no free port within the probes
	EventConfirmFull = Event(masqEventEV_CONFIRM_FULL) // two-way flows the confirmed table had no room for
	EventConfirmed   = Event(masqEventEV_CONFIRMED)    // two-way flows moved to the confirmed table

	numEvents = int(masqEventEV_MAX)
)

// Events lists every event, in counter order.
func Events() []Event {
	evs := make([]Event, numEvents)
	for i := range evs {
		evs[i] = Event(i)
	}
	return evs
}

// String is the event's name, its metric label: "new_masq" for EV_NEW_MASQ.
func (e Event) String() string {
	if int(e) >= numEvents {
		return fmt.Sprintf("event_%d", uint32(e))
	}
	return strings.ToLower(masqEvent(e).String())
}

// dropPrefix starts the names of the events that count dropped packets (EV_DROP_*).
const dropPrefix = "drop_"

// DropReason is the reason of a drop event, its name without "drop_" ("no_port" for
// drop_no_port); ok is false for an event that is not a drop.
func (e Event) DropReason() (reason string, ok bool) {
	return strings.CutPrefix(e.String(), dropPrefix)
}

// EventCounts reads every event counter, summed over CPUs.
func (d *Datapath) EventCounts() (map[Event]uint64, error) {
	out := make(map[Event]uint64, numEvents)
	for _, e := range Events() {
		n, err := d.eventCount(e)
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		out[e] = n
	}
	return out, nil
}

// eventCount reads one event counter, summed over CPUs.
func (d *Datapath) eventCount(e Event) (uint64, error) {
	var per []uint64
	if err := d.objs.EventStats.Lookup(uint32(e), &per); err != nil {
		return 0, fmt.Errorf("read event_stats[%s]: %w", e, err)
	}
	var n uint64
	for _, c := range per {
		n += c
	}
	return n, nil
}

// PortAttempts is the histogram of the probes that successful port allocations took (the
// port_attempts map: its last slot holds the sum, the others the buckets).
type PortAttempts struct {
	// Counts[i] is how many allocations took at most PortAttemptBound(i) probes, and more than
	// the bound of the bucket before.
	Counts []uint64
	Sum    uint64 // the probes of all those allocations
}

// PortAttemptBound is the upper bound of bucket i: 2^i probes.
func PortAttemptBound(i int) float64 { return float64(uint64(1) << i) }

// PortAttempts reads the port allocation histogram, summed over CPUs.
func (d *Datapath) PortAttempts() (PortAttempts, error) {
	n := int(d.objs.PortAttempts.MaxEntries())
	out := PortAttempts{Counts: make([]uint64, n-1)}
	for i := range n {
		var per []uint64
		if err := d.objs.PortAttempts.Lookup(uint32(i), &per); err != nil {
			return PortAttempts{}, fmt.Errorf("read port_attempts[%d]: %w", i, err)
		}
		var sum uint64
		for _, c := range per {
			sum += c
		}
		if i == n-1 {
			out.Sum = sum
		} else {
			out.Counts[i] = sum
		}
	}
	return out, nil
}
