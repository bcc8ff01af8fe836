package bpf

import (
	"bytes"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
)

// keyByKey is a mapReader as on a kernel without batch operations (before 5.6): this machine's
// kernel has them, so the fallback is tested by starting where a refused batch leaves it.
func keyByKey(m *ebpf.Map) mapReader { return mapReader{m: m, it: m.Iterate()} }

// byKeyWalk is a mapWalk that reads key by key.
func byKeyWalk[K, V any](m *ebpf.Map, batch int) *mapWalk[K, V] {
	return &mapWalk[K, V]{mapReader: keyByKey(m), keys: make([]K, batch), vals: make([]V, batch)}
}

// TestRawWalkByKey: the raw walk for kernels without batch lookups reads the same bytes as the
// batched one, over more than one batch.
func TestRawWalkByKey(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{NATEntries: 1 << 14})
	fillFlows(t, h.dp, 0, rawWalkBatch/2+10, MonotonicNow())
	read := func(each func(fn func(k, v []byte) error) error) []string {
		t.Helper()
		var entries []string
		if err := each(func(k, v []byte) error {
			entries = append(entries, string(bytes.Join([][]byte{k, v}, []byte{'|'})))
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		slices.Sort(entries)
		return entries
	}
	m := h.dp.objs.NatV4
	batched := read(func(fn func(k, v []byte) error) error { return walkRaw(m, fn) })
	r := keyByKey(m)
	byKey := read(r.eachRaw)
	if len(batched) != 2*(rawWalkBatch/2+10) || !slices.Equal(batched, byKey) {
		t.Fatalf("batched walk read %d entries, by key %d, want %d alike", len(batched), len(byKey), 2*(rawWalkBatch/2+10))
	}
}
