package bpf

import "unsafe"

// Kernel memory of the NAT tables, as the kernel lays out a preallocated hash map: an element
// per entry (a header, then the key and the value, each rounded up to 8 bytes) and a bucket per
// entry rounded up to a power of two.
const (
	htabElemHeader = 48
	htabBucket     = 16
)

func htabBytes(entries uint32, key, value uintptr) uint64 {
	round := func(n uintptr) uint64 { return uint64(n+7) &^ 7 }
	buckets := uint64(1)
	for buckets < uint64(entries) {
		buckets <<= 1
	}
	return uint64(entries)*(htabElemHeader+round(key)+round(value)) + buckets*htabBucket
}

// NATMemory is the kernel memory, in bytes, of one family's NAT tables when LoadOptions sizes its
// confirmed table at n entries (the unreplied, keep and inbound tables follow from n).
func NATMemory(n uint32, v6 bool) uint64 {
	key := unsafe.Sizeof(masqNat4Key{})
	if v6 {
		key = unsafe.Sizeof(masqNat6Key{})
	}
	value, keep := unsafe.Sizeof(masqNatEntry{}), unsafe.Sizeof(masqKeepEntry{})
	return htabBytes(n, key, value) + htabBytes(unrepliedEntries(n), key, value) + htabBytes(keepEntries(n), key, keep) +
		htabBytes(inboundEntries(n), key, value)
}
