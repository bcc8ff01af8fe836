package bpf

import (
	"cmp"
	"fmt"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// FlowState is what a flow's two halves have seen.
type FlowState uint8

const (
	// StateUnreplied: packets went one way only so far.
	StateUnreplied FlowState = iota
	// StateEstablished: packets went both ways.
	StateEstablished
	// StateClosing: a TCP FIN or RST went either way.
	StateClosing
	// StateKept: a flow the policy left alone, whose verdict is kept (the keep table).
	StateKept
)

func (s FlowState) String() string {
	switch s {
	case StateEstablished:
		return "established"
	case StateClosing:
		return "closing"
	case StateKept:
		return "kept"
	}
	return "unreplied"
}

// StateOf is the state of a flow from the flags of its two halves (the datapath sets the state's
// flags on both, so either half alone tells it too: pass 0 for a missing partner's).
func StateOf(half, partner Flags) FlowState {
	switch f := half | partner; {
	case f&(FlagFIN|FlagRST) != 0:
		return StateClosing
	case f&FlagReplied != 0:
		return StateEstablished
	}
	return StateUnreplied
}

// timeout is how long a flow in a state may be idle.
func (t Timeouts) timeout(proto uint8, state FlowState) time.Duration {
	switch proto {
	case unix.IPPROTO_TCP:
		switch state {
		case StateClosing:
			return t.TCPClosing
		case StateEstablished, StateKept: // a kept connection's verdict: until the pod closes it
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

// shortestOfAll is the least time any flow is kept idle, whatever its protocol and state.
func (t Timeouts) shortestOfAll() time.Duration {
	return min(t.TCPEstablished, t.TCPOpening, t.TCPClosing, t.UDP, t.ICMP, t.Other)
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
	if err := d.natTable(fam).flows(fn); err != nil {
		return fmt.Errorf("read %s nat table: %w", fam, err)
	}
	return nil
}

func (t natTableOf[K]) flows(fn func(Flow) bool) error {
	var inner error
	err := t.each(func(k K, v *masqNatEntry, tbl Table) bool {
		kt := k.tuple()
		if kt.dir != Egress {
			return true
		}
		pk, pv, paired, err := t.lookupPartner(k, v)
		if err != nil {
			inner = err
			return false
		}
		f := Flow{Egress: kt.decode(v), Partial: !paired}
		f.Egress.Table = tbl
		if paired {
			f.Ingress = pk.tuple().decode(&pv)
			f.Ingress.Table = tbl
		}
		f.State = StateOf(f.Egress.Flags, f.Ingress.Flags) // a missing half has no flags
		return fn(f)
	})
	return cmp.Or(inner, err)
}
