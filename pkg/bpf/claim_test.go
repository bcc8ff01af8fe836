package bpf

import (
	"errors"
	"strings"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// TestResetSlots: the slots a sync claims have zero counters on every CPU and their new owners,
// whether claim_slots does it in the kernel (over more than one batch) or, where that program
// cannot load, the batch updates do; the slots around them keep theirs.
func TestResetSlots(t *testing.T) {
	for _, mode := range []string{"kernel", "userspace"} {
		t.Run(mode, func(t *testing.T) {
			h := newHarness(t, nil, LoadOptions{MaxRules: uint32(4 * claimBatch)})
			d := h.dp
			if mode == "kernel" {
				if err := ClaimsUnsupported(); errors.Is(err, ebpf.ErrNotSupported) {
					testutil.NotOnThisKernel(t, "claim_slots' helpers (the fallback, userspace, runs here too): %v", err)
				} else if err != nil {
					t.Fatal(err)
				}
				if d.claim == nil {
					t.Fatalf("claim_slots did not load where the kernel has its helpers: %v", d.claimErr)
				}
			} else if d.claim != nil {
				if err := d.claim.close(); err != nil {
					t.Fatal(err)
				}
				d.claim = nil
			}
			cpus := ebpf.MustPossibleCPU()
			dirty := make([]masqRuleStats, cpus)
			for c := range dirty {
				dirty[c] = masqRuleStats{Packets: uint64(c + 1), Bytes: uint64(100 * (c + 1))}
			}
			stranger := masqRuleSlot{Prefixlen: 9, Family: 4}
			// Two slots of every three from 1, across two batch boundaries; the rest stay dirty.
			var slots []uint32
			var keys []slotKey
			for s := uint32(1); s < uint32(3*claimBatch+300); s++ {
				if err := d.objs.RuleStats.Put(s, dirty); err != nil {
					t.Fatal(err)
				}
				if err := d.objs.RuleSlots.Put(s, &stranger); err != nil {
					t.Fatal(err)
				}
				if s%3 != 0 {
					slots = append(slots, s)
					keys = append(keys, slotKey{family: policy.IPv4, bits: uint8(s % 33), dup: uint16(s), origin: 1, addr: [16]byte{10, byte(s >> 8), byte(s)}})
				}
			}
			if err := d.resetSlots(slots, func(i int) slotKey { return keys[i] }); err != nil {
				t.Fatal(err)
			}
			claimed := map[uint32]slotKey{}
			for i, s := range slots {
				claimed[s] = keys[i]
			}
			for s := uint32(1); s < uint32(3*claimBatch+300); s++ {
				var per []masqRuleStats
				if err := d.objs.RuleStats.Lookup(s, &per); err != nil {
					t.Fatal(err)
				}
				var owner masqRuleSlot
				if err := d.objs.RuleSlots.Lookup(s, &owner); err != nil {
					t.Fatal(err)
				}
				want, wantOwner := dirty, stranger
				if k, ok := claimed[s]; ok {
					want, wantOwner = make([]masqRuleStats, cpus), k.value()
				}
				for c := range per {
					if per[c] != want[c] {
						t.Fatalf("slot %d cpu %d: counters %+v, want %+v", s, c, per[c], want[c])
					}
				}
				if owner != wantOwner {
					t.Fatalf("slot %d: owner %+v, want %+v", s, owner, wantOwner)
				}
			}
			// A slot past the maps is refused, not dropped in silence.
			beyond := d.objs.RuleSlots.MaxEntries()
			err := d.resetSlots([]uint32{2, beyond}, func(i int) slotKey { return keys[i] })
			if err == nil {
				t.Fatalf("a claim of slot %d of %d: no error", beyond, beyond)
			}
			if mode == "kernel" && !strings.Contains(err.Error(), "1 of 2 slots not claimed") {
				t.Fatalf("a claim of slot %d of %d: %v", beyond, beyond, err)
			}
		})
	}
}
