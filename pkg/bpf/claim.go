package bpf

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
)

// claimer runs bpf/claim.c's claim_slots over a datapath's rule_stats and rule_slots: the slots a
// sync gives to new rules zeroed on every CPU and given their owners in the kernel, a syscall per
// batch of claimBatch slots instead of two batch updates whose per-CPU values cilium/ebpf would
// convert one CPU and key at a time (most of a 100k-rule swap's time before its first trie
// write, docs/benchmarks.md).
type claimer struct {
	objs  claimObjects
	cpus  uint32
	batch claimClaimBatch
}

const claimBatch = len(claimClaimBatch{}.Items)

// loadClaimer loads claim_slots over rule_stats and rule_slots, or says why it cannot (a kernel
// before 5.19 has no bpf_map_lookup_percpu_elem; the caller then writes the maps itself).
func loadClaimer(ruleStats, ruleSlots *ebpf.Map) (*claimer, error) {
	if err := ClaimsUnsupported(); err != nil {
		return nil, err
	}
	spec, err := loadClaim()
	if err != nil {
		return nil, fmt.Errorf("load claim spec: %w", err)
	}
	spec.Maps[claimMapRuleStats].MaxEntries = ruleStats.MaxEntries()
	spec.Maps[claimMapRuleSlots].MaxEntries = ruleSlots.MaxEntries()
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		return nil, fmt.Errorf("count possible cpus: %w", err)
	}
	c := &claimer{cpus: uint32(cpus)}
	err = spec.LoadAndAssign(&c.objs, &ebpf.CollectionOptions{
		MapReplacements: map[string]*ebpf.Map{claimMapRuleStats: ruleStats, claimMapRuleSlots: ruleSlots},
	})
	if err != nil {
		var verr *ebpf.VerifierError
		if errors.As(err, &verr) {
			return nil, fmt.Errorf("load claim_slots: %+v", verr)
		}
		return nil, fmt.Errorf("load claim_slots: %w", err)
	}
	return c, nil
}

// claim zeroes slots' counters on every CPU and records owner(i) as the owner of slots[i].
func (c *claimer) claim(slots []uint32, owner func(i int) slotKey) error {
	for start := 0; start < len(slots); start += claimBatch {
		n := min(claimBatch, len(slots)-start)
		for i := range n {
			o := owner(start + i).value() // rule_slots' record, as the batch updates write it
			c.batch.Items[i] = claimSlotClaim{Slot: slots[start+i], Owner: claimRuleSlot{
				Addr: o.Addr, Prefixlen: o.Prefixlen, Family: o.Family,
				Action: uint8(o.Action), Origin: uint8(o.Origin), Dup: o.Dup,
			}}
		}
		if err := c.objs.Claims.Put(uint32(0), &c.batch); err != nil {
			return fmt.Errorf("write the claim batch: %w", err)
		}
		ret, err := c.objs.ClaimSlots.Run(&ebpf.RunOptions{Context: claimClaimArgs{N: uint32(n), Cpus: c.cpus}})
		if err != nil {
			return fmt.Errorf("run claim_slots: %w", err)
		}
		if r := int32(ret); r < 0 {
			return fmt.Errorf("claim_slots: error %d", r)
		} else if r > 0 {
			return fmt.Errorf("claim_slots: %d of %d slots not claimed (out of the maps' range)", r, n)
		}
	}
	return nil
}

func (c *claimer) close() error { return c.objs.Close() }
