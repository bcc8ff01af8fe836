package bpf

import (
	"bytes"
	"cmp"
	"slices"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// TestSweepManyBatches: over a table that takes several batches to read, the sweep removes
// exactly the idle flows (both halves), keeps every live one, and counts what it removed.
func TestSweepManyBatches(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{NATEntries: 1 << 16})
	now := MonotonicNow()
	const live, idle = 3 * natBatch, natBatch + 123
	fillFlows(t, h.dp, 0, live, now)
	fillFlows(t, h.dp, live, idle, now-3*time.Minute) // past the UDP timeout
	if n := natCount(t, h.dp); n != 2*(live+idle) {
		t.Fatalf("filled %d entries, want %d", n, 2*(live+idle))
	}
	before, err := h.dp.SweptEntries()
	if err != nil {
		t.Fatal(err)
	}
	res, err := h.dp.Sweep(now, DefaultTimeouts)
	if err != nil {
		t.Fatal(err)
	}
	if res.Swept != (Swept{Flows: idle}) {
		t.Errorf("sweep removed %+v, want %d flows", res, idle)
	}
	if n := natCount(t, h.dp); n != 2*live {
		t.Errorf("%d entries left, want the %d of the live flows", n, 2*live)
	}
	if err := h.dp.NATEntries(policy.IPv4, func(e NATEntry) bool {
		if e.LastSeen != now {
			t.Errorf("an idle entry is left: %+v", e)
			return false
		}
		return true
	}); err != nil {
		t.Fatal(err)
	}
	after, err := h.dp.SweptEntries()
	if err != nil {
		t.Fatal(err)
	}
	if got := after[17] - before[17]; got != 2*idle {
		t.Errorf("swept UDP entries counted %d, want %d", got, 2*idle)
	}
	if res, err := h.dp.Sweep(now, DefaultTimeouts); err != nil || res.Swept != (Swept{}) {
		t.Errorf("a second sweep removed %+v (%v)", res, err)
	}
}

// TestWalkNATByKey: the walk for kernels without batch operations sees the same entries as the
// batched one, in batches of at most natBatch, and stops when asked.
func TestWalkNATByKey(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{NATEntries: 1 << 15})
	fillFlows(t, h.dp, 0, natBatch+10, MonotonicNow())
	collect := func(walk func(func([]masqNat4Key, []masqNatEntry, int) bool) error, stopAfter int) ([]masqNat4Key, int) {
		t.Helper()
		var keys []masqNat4Key
		calls := 0
		if err := walk(func(ks []masqNat4Key, vs []masqNatEntry, n int) bool {
			calls++
			if n > natBatch {
				t.Fatalf("a batch of %d entries", n)
			}
			for i := range n {
				if vs[i].Kind != masqNatKind(KindMasq) {
					t.Fatalf("entry %+v has value %+v", ks[i], vs[i])
				}
			}
			keys = append(keys, ks[:n]...)
			return calls != stopAfter
		}); err != nil {
			t.Fatal(err)
		}
		return keys, calls
	}
	less := func(a, b masqNat4Key) int {
		return cmp.Or(bytes.Compare(a.Saddr[:], b.Saddr[:]), bytes.Compare(a.Daddr[:], b.Daddr[:]), cmp.Compare(a.Sport, b.Sport),
			cmp.Compare(a.Dport, b.Dport), cmp.Compare(a.Dir, b.Dir))
	}
	batched, _ := collect(func(fn func([]masqNat4Key, []masqNatEntry, int) bool) error {
		return walkNAT(h.dp.objs.NatV4, fn)
	}, 0)
	byKey, calls := collect(func(fn func([]masqNat4Key, []masqNatEntry, int) bool) error {
		return byKeyWalk[masqNat4Key, masqNatEntry](h.dp.objs.NatV4, natBatch).each(fn)
	}, 0)
	if len(batched) != 2*(natBatch+10) || calls != 3 {
		t.Fatalf("batched walk saw %d entries, key walk %d calls", len(batched), calls)
	}
	slices.SortFunc(batched, less)
	slices.SortFunc(byKey, less)
	if !slices.Equal(batched, byKey) {
		t.Errorf("the walks differ: %d and %d entries", len(batched), len(byKey))
	}
	if part, calls := collect(func(fn func([]masqNat4Key, []masqNatEntry, int) bool) error {
		return byKeyWalk[masqNat4Key, masqNatEntry](h.dp.objs.NatV4, natBatch).each(fn)
	}, 1); calls != 1 || len(part) != natBatch {
		t.Errorf("a walk stopped after one batch made %d calls with %d entries", calls, len(part))
	}
}

// TestDeleteAll: keys that are gone already are skipped, the others deleted.
func TestDeleteAll(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{NATEntries: 1 << 10})
	fillFlows(t, h.dp, 0, 3, MonotonicNow())
	var keys []masqNat4Key
	if err := walkNAT(h.dp.objs.NatV4, func(ks []masqNat4Key, _ []masqNatEntry, n int) bool {
		keys = append(keys, ks[:n]...)
		return true
	}); err != nil {
		t.Fatal(err)
	}
	missing := keys[1]
	missing.Sport++
	doomed := []masqNat4Key{keys[0], missing, keys[1], missing}
	gone, err := deleteAll(h.dp.objs.NatV4, doomed)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(gone, []bool{true, false, true, false}) {
		t.Errorf("deleted %v", gone)
	}
	if n := natCount(t, h.dp); n != 4 {
		t.Errorf("%d entries left, want 4", n)
	}
}
