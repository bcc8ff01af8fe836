package bpf

import (
	"encoding/binary"
	"net/netip"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
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

// masqueradeAddress is the family's masqueradeAddress as nat_config holds it (family_cfg.snat),
// invalid where it holds none (all zero: each uplink's own address is used). The programs read it
// there and nowhere else (bpf/scope.h: uplink_snat_of).
func (c *masqNatConfig) masqueradeAddress(fam policy.Family) netip.Addr {
	b := c.V4.Snat
	if fam == policy.IPv6 {
		b = c.V6.Snat
	}
	if b == ([16]byte{}) {
		return netip.Addr{}
	}
	return bytesAddr(fam == policy.IPv6, b)
}

// setMasqueradeAddress makes nat_config hold a as the family's masqueradeAddress (invalid: none).
func (c *masqNatConfig) setMasqueradeAddress(fam policy.Family, a netip.Addr) {
	var b [16]byte
	if a.IsValid() {
		b = addrBytes(a.Unmap())
	}
	if fam == policy.IPv6 {
		c.V6.Snat = b
	} else {
		c.V4.Snat = b
	}
}

// htons converts a port to the native value of its network-order bytes.
func htons(p uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], p)
	return binary.NativeEndian.Uint16(b[:])
}

// ntohs is the inverse of htons.
func ntohs(p uint16) uint16 { return htons(p) }
