package bpf

import (
	"encoding/binary"
	"net/netip"
)

// The C structs hold addresses as byte arrays in network order (the fields that hold either
// family have IPv4 in their first 4 bytes) and ports as network-order integers, whose generated
// Go fields are native integers over the same bytes.

// addrBytes is the form of the fields that hold either family.
func addrBytes(a netip.Addr) [16]byte {
	if a.Is4() {
		var b [16]byte
		b4 := a.As4()
		copy(b[:], b4[:])
		return b
	}
	return a.As16()
}

// bytesAddr is the address a field of either family holds.
func bytesAddr(v6 bool, b [16]byte) netip.Addr {
	if v6 {
		return netip.AddrFrom16(b)
	}
	return netip.AddrFrom4([4]byte(b[:4]))
}

// htons converts a port to the native value of its network-order bytes.
func htons(p uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], p)
	return binary.NativeEndian.Uint16(b[:])
}

// ntohs is the inverse of htons.
func ntohs(p uint16) uint16 { return htons(p) }
