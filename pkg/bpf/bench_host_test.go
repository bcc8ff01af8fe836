package bpf

import (
	"testing"
)

// BenchmarkIngressHostService: a packet to a host service on the uplink address (a port outside
// the NAT range, held by no flow of an earlier range): not looked up in the NAT tables.
func BenchmarkIngressHostService(b *testing.B) {
	h := benchHarness(b, 1)
	frame := tcpPacket(ap(remote4, 40000), ap(snat4, 22), tcpACK, make([]byte, 64))
	measure(b, h, h.dp.Ingress(), tcNext, func(int) []byte { return frame })
}

// BenchmarkEgressHostService: a host service's answer from a port outside the NAT range: no
// entry found, none recorded.
func BenchmarkEgressHostService(b *testing.B) {
	h := benchHarness(b, 1)
	frame := tcpPacket(ap(snat4, 22), ap(remote4, 40000), tcpACK, make([]byte, 64))
	measure(b, h, h.dp.Egress(), tcNext, func(int) []byte { return frame })
}
