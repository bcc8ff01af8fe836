package bpf

import (
	"errors"
	"reflect"
	"unsafe"

	"github.com/cilium/ebpf"
)

// Bulk reads and writes of the maps. Batch operations (BPF_MAP_*_BATCH, 5.6) move thousands of
// entries in a syscall; where the kernel or the map type refuses them (ErrNotSupported), the
// same work is done key by key. Every bulk access of this package goes through this file, so
// the fallback is written once.

// putAll writes values at keys, in one batch where the kernel can. For a per-CPU map values
// holds one value per CPU for each key, key after key.
func putAll[K, V any](m *ebpf.Map, keys []K, values []V) error {
	if len(keys) == 0 {
		return nil
	}
	_, err := m.BatchUpdate(keys, values, nil)
	if !errors.Is(err, ebpf.ErrNotSupported) {
		return err
	}
	per := len(values) / len(keys)
	for i := range keys {
		var v any = &values[i]
		if per > 1 {
			v = values[i*per : (i+1)*per]
		}
		if err := m.Put(&keys[i], v); err != nil {
			return err
		}
	}
	return nil
}

// deleteAll deletes keys, a batch at a time where the kernel can, and tells which it deleted: a
// key that is gone already (an LRU eviction, another CPU, a drift) is skipped.
func deleteAll[K any](m *ebpf.Map, keys []K) ([]bool, error) {
	gone := make([]bool, len(keys))
	for at := 0; at < len(keys); {
		n, err := m.BatchDelete(keys[at:], nil)
		if errors.Is(err, ebpf.ErrNotSupported) {
			for i := at; i < len(keys); i++ {
				err := m.Delete(&keys[i])
				if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
					return nil, err
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
			return nil, err
		}
	}
	return gone, nil
}

// mapReader reads a map some entries at a time, and can pause between reads and go on later.
// It reads with BPF_MAP_LOOKUP_BATCH, bucket by bucket for a hash map: the cursor is the next
// bucket's index, and a hash map's buckets never move, so a map the programs change meanwhile
// is still read once (each entry that stays is read once; one added or removed meanwhile may be
// missed), however long the pause. A kernel without batch operations is read key by key.
type mapReader struct {
	m      *ebpf.Map
	cursor ebpf.MapBatchCursor
	it     *ebpf.MapIterator // key by key, once the kernel refused a batch
}

// read reads up to n entries into keys and vals, buffers of n entries as BatchLookup takes
// them; read key by key, entry i goes to at(i), its key and value as MapIterator.Next takes
// them. over tells that the map ends there.
func (r *mapReader) read(keys, vals any, n int, at func(i int) (key, val any)) (got int, over bool, err error) {
	if r.it == nil {
		got, err := r.m.BatchLookup(&r.cursor, keys, vals, nil)
		if !errors.Is(err, ebpf.ErrNotSupported) {
			over := errors.Is(err, ebpf.ErrKeyNotExist)
			if err != nil && !over {
				return 0, false, err
			}
			return got, over, nil
		}
		r.it = r.m.Iterate()
	}
	for ; got < n; got++ {
		if k, v := at(got); !r.it.Next(k, v) {
			return got, true, r.it.Err()
		}
	}
	return got, false, nil
}

// readInto is read into typed buffers of the same length.
func readInto[K, V any](r *mapReader, keys []K, vals []V) (int, bool, error) {
	return r.read(keys, vals, len(keys), func(i int) (any, any) { return &keys[i], &vals[i] })
}

// mapWalk is a mapReader with buffers of its own for a batch of entries of types K and V.
type mapWalk[K, V any] struct {
	mapReader
	keys []K
	vals []V
}

func newMapWalk[K, V any](m *ebpf.Map, batch int) *mapWalk[K, V] {
	return &mapWalk[K, V]{mapReader: mapReader{m: m}, keys: make([]K, batch), vals: make([]V, batch)}
}

// restart makes w walk m from its start, with the same buffers.
func (w *mapWalk[K, V]) restart(m *ebpf.Map) { w.mapReader = mapReader{m: m} }

// next reads the next batch into keys[:n] and vals[:n]; over tells that the map ends there.
func (w *mapWalk[K, V]) next() (n int, over bool, err error) {
	return readInto(&w.mapReader, w.keys, w.vals)
}

// each calls fn with each batch to the map's end, until fn returns false: keys[:n] and
// vals[:n] hold the batch, valid only during the call.
func (w *mapWalk[K, V]) each(fn func(keys []K, vals []V, n int) bool) error {
	for {
		n, over, err := w.next()
		if err != nil {
			return err
		}
		if n > 0 && !fn(w.keys, w.vals, n) || over {
			return nil
		}
	}
}

// entryBatch is how many entries eachEntry reads per syscall.
const entryBatch = 1024

// eachEntry calls fn with every entry of a map without per-CPU values: a batch lookup per
// thousand entries where the kernel can (a rule map of 32768 slots is read in a few syscalls),
// else a syscall per entry.
func eachEntry[K, V any](m *ebpf.Map, fn func(K, *V)) error {
	return newMapWalk[K, V](m, entryBatch).each(func(keys []K, vals []V, n int) bool {
		for i := range n {
			fn(keys[i], &vals[i])
		}
		return true
	})
}

// rawBatch is a buffer of n entries of size bytes each, as the slice of arrays the library's
// batch operations take, and its bytes.
func rawBatch(n, size int) (any, []byte) {
	v := reflect.MakeSlice(reflect.SliceOf(reflect.ArrayOf(size, reflect.TypeFor[byte]())), n, n)
	return v.Interface(), unsafe.Slice((*byte)(v.UnsafePointer()), n*size)
}

// rawWalkBatch is how many entries walkRaw reads per syscall.
const rawWalkBatch = 4096

// walkRaw calls fn with every entry of a map without per-CPU values, its key and value as bytes
// valid during the call (a map of an older layout has no Go types in this build).
func walkRaw(m *ebpf.Map, fn func(key, value []byte) error) error {
	return (&mapReader{m: m}).eachRaw(fn)
}

// eachRaw is walkRaw from where r is.
func (r *mapReader) eachRaw(fn func(key, value []byte) error) error {
	ks, vs := int(r.m.KeySize()), int(r.m.ValueSize())
	keys, kb := rawBatch(rawWalkBatch, ks)
	vals, vb := rawBatch(rawWalkBatch, vs)
	key := func(i int) []byte { return kb[i*ks : (i+1)*ks] }
	val := func(i int) []byte { return vb[i*vs : (i+1)*vs] }
	for {
		n, over, err := r.read(keys, vals, rawWalkBatch, func(i int) (any, any) { return key(i), val(i) })
		if err != nil {
			return err
		}
		for i := range n {
			if err := fn(key(i), val(i)); err != nil {
				return err
			}
		}
		if over {
			return nil
		}
	}
}
