package bpf

import (
	"errors"
	"fmt"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Later fragments that came before their datagram's first fragment wait in frag_held_v4/v6 until
// it comes (bpf/frag.h); the sweep removes those that waited longer than the kernel's own
// reassembly would have.

// FragHoldTimeout is how long a held fragment of a family waits for its first fragment: the
// kernel's defaults for reassembly, net.ipv4.ipfrag_time (30 s) and net.ipv6.ip6frag_time (60 s).
func FragHoldTimeout(fam policy.Family) time.Duration {
	if fam == policy.IPv6 {
		return 60 * time.Second
	}
	return 30 * time.Second
}

// heldMap is the map of a family's held fragments.
func (d *Datapath) heldMap(fam policy.Family) *ebpf.Map {
	if fam == policy.IPv6 {
		return d.objs.FragHeldV6
	}
	return d.objs.FragHeldV4
}

// sweepHeld removes the held fragments that waited longer than FragHoldTimeout at now, and
// returns how many it removed and how many it left.
func (d *Datapath) sweepHeld(now time.Duration) (removed, left int, err error) {
	for _, fam := range policy.Families() {
		var found, n int
		if fam == policy.IPv6 {
			found, n, err = scanHeld[masqFrag6HeldKey](d.heldMap(fam), now, FragHoldTimeout(fam))
		} else {
			found, n, err = scanHeld[masqFrag4HeldKey](d.heldMap(fam), now, FragHoldTimeout(fam))
		}
		if err != nil {
			return removed, left, fmt.Errorf("sweep held %s fragments: %w", fam, err)
		}
		removed += n
		left += found - n
	}
	return removed, left, nil
}

// scanHeld counts the entries of a held-fragment map and, when timeout is not 0, removes those
// held longer than timeout at now (one that is still being written has no time yet, and goes
// too: its writer is long done). It returns how many it found and how many it removed.
func scanHeld[K any](m *ebpf.Map, now, timeout time.Duration) (found, removed int, err error) {
	var (
		k      K
		v      masqFragHeld
		doomed []K
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		found++
		if timeout != 0 && now-time.Duration(v.HeldAt) > timeout {
			doomed = append(doomed, k)
		}
	}
	if err := it.Err(); err != nil {
		return found, 0, fmt.Errorf("iterate %s: %w", m, err)
	}
	for _, k := range doomed {
		if err := m.Delete(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return found, removed, fmt.Errorf("delete from %s: %w", m, err)
		}
		removed++
	}
	return found, removed, nil
}
