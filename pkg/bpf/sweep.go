package bpf

import (
	"cmp"
	"errors"
	"fmt"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

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
	for _, fam := range []policy.Family{policy.IPv4, policy.IPv6} {
		if err := d.natTable(fam).sweep(now, t, &res, swept); err != nil {
			return res, fmt.Errorf("sweep: %w", err)
		}
	}
	return res, nil
}

// sweep is Sweep on one NAT table.
func (table natTableOf[K]) sweep(now time.Duration, t Timeouts, res *SweepResult, swept map[uint8]uint64) error {
	m := table.m
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
			kt := k.tuple()
			if now-time.Duration(v.LastSeen) <= t.shortest(kt.proto) {
				continue
			}
			pk, pv, paired, err := lookupPartner(m, k, v)
			if err != nil {
				inner = err
				return false
			}
			last, partnerFlags := v.LastSeen, Flags(0)
			if paired {
				if kt.dir != Egress {
					continue // a flow is judged once, from its egress half
				}
				last, partnerFlags = max(last, pv.LastSeen), Flags(pv.Flags)
			}
			if now-time.Duration(last) <= t.timeout(kt.proto, StateOf(Flags(v.Flags), partnerFlags)) {
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
					swept[doomed[j].tuple().proto]++
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
	if err := eachEntry(d.objs.SweepStats, func(proto uint32, n *uint64) {
		if *n > 0 {
			out[uint8(proto)] = *n
		}
	}); err != nil {
		return nil, fmt.Errorf("read sweep_stats: %w", err)
	}
	return out, nil
}
