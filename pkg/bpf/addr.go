package bpf

import (
	"encoding/binary"
	"net/netip"
)

// The C structs hold addresses and ports in network byte order; the generated Go fields are
// native integers over the same bytes. These helpers convert without changing the bytes.

func be32(b []byte) uint32 { return binary.NativeEndian.Uint32(b) }

func addr4Word(a netip.Addr) uint32 {
	b := a.As4()
	return be32(b[:])
}

func addr6Words(a netip.Addr) [4]uint32 {
	b := a.As16()
	return [4]uint32{be32(b[0:]), be32(b[4:]), be32(b[8:]), be32(b[12:])}
}

// addrWords is the [4]uint32 form of the C structs that hold either family (IPv4 in [0]).
func addrWords(a netip.Addr) [4]uint32 {
	if a.Is4() {
		return [4]uint32{addr4Word(a)}
	}
	return addr6Words(a)
}

func word4Addr(w uint32) netip.Addr {
	var b [4]byte
	binary.NativeEndian.PutUint32(b[:], w)
	return netip.AddrFrom4(b)
}

func words6Addr(w [4]uint32) netip.Addr {
	var b [16]byte
	for i, x := range w {
		binary.NativeEndian.PutUint32(b[4*i:], x)
	}
	return netip.AddrFrom16(b)
}

func wordsAddr(v6 bool, w [4]uint32) netip.Addr {
	if v6 {
		return words6Addr(w)
	}
	return word4Addr(w[0])
}

// htons converts a port to the native value of its network-order bytes.
func htons(p uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], p)
	return binary.NativeEndian.Uint16(b[:])
}

// ntohs is the inverse of htons.
func ntohs(p uint16) uint16 { return htons(p) }
