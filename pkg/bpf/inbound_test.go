package bpf

import (
	"bytes"
	"net/netip"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// Services on addresses the node does not own: kube-proxy DNATs them to a pod, and its conntrack
// translates the pod's replies back.

// serviceAddr is a Service address routed to the node but not on it: in the harness's namespace
// it is routed back out lo, the device the packets come by, as the node's default route would
// route a load-balancer IP nothing DNATs.
func serviceAddr(v6 bool) netip.Addr {
	if v6 {
		return netip.MustParseAddr("2001:db8:7777::80")
	}
	return netip.MustParseAddr("203.0.113.80")
}

// TestRepliesOfServicesOnOutsideAddresses: a connection from a client the policy masquerades to
// a Service address the node does not own, which kube-proxy DNATs to a pod: the pod's replies,
// which conntrack translates back to the Service address, leave untouched (TCP: the SYN-ACK is
// not dropped; UDP: the answer keeps its source), and the flow carries on as an inbound one. A
// packet from that address that answers nothing still opens a masqueraded flow.
func TestRepliesOfServicesOnOutsideAddresses(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h.t = t
			svc, client := serviceAddr(fam.v6), ap(remote(fam.v6), 40000)
			h.mustPass(h.dp.Ingress(), tcpSegment(client, ap(svc, 80), seg{flags: tcpSYN, seq: 100, win: 64240, wscale: 7}))
			synack := tcpSegment(ap(svc, 80), client, seg{flags: tcpSYN | tcpACK, seq: 900, ack: 101, win: 65160, wscale: 7})
			if ret, out := h.egress(synack); ret != tcNext || !bytes.Equal(out[:len(synack)], synack) {
				t.Fatalf("the pod's SYN-ACK from the Service address: verdict %d, changed %v, want it passed untouched",
					int32(ret), !bytes.Equal(out[:len(synack)], synack))
			}
			ack := tcpSegment(client, ap(svc, 80), seg{flags: tcpACK, seq: 101, ack: 901, win: 502, wscale: -1})
			if out := h.mustPass(h.dp.Ingress(), ack); !bytes.Equal(out[:len(ack)], ack) {
				t.Fatalf("the client's ACK to the Service address was translated to %s", tupleOf(t, out).dst)
			}
			data := tcpSegment(ap(svc, 80), client, seg{flags: tcpACK, seq: 901, ack: 101, win: 502, wscale: -1, payload: payload})
			if out := h.mustPass(h.dp.Egress(), data); !bytes.Equal(out[:len(data)], data) {
				t.Fatalf("the pod's data from the Service address was translated to %s", tupleOf(t, out).src)
			}
			if e, ok := h.entry(Egress, unix.IPPROTO_TCP, ap(svc, 80), client); !ok || e.Kind != KindInbound {
				t.Fatalf("the connection to the Service address is no inbound flow: %+v (found %v)", e, ok)
			}

			udpClient := ap(remote(fam.v6), 40001)
			h.mustPass(h.dp.Ingress(), udpPacket(udpClient, ap(svc, 53), payload))
			answer := udpPacket(ap(svc, 53), udpClient, payload)
			if out := h.mustPass(h.dp.Egress(), answer); !bytes.Equal(out[:len(answer)], answer) {
				t.Fatalf("the pod's UDP answer from the Service address left as %s", tupleOf(t, out).src)
			}

			// A datagram from the Service address that answers no request is a new flow.
			unasked := udpPacket(ap(svc, 54), ap(remote(fam.v6), 40002), payload)
			if got := tupleOf(t, h.mustPass(h.dp.Egress(), unasked)).src.Addr(); got != snatFor(svc) {
				t.Fatalf("a datagram from the Service address that answers nothing left from %s, want %s", got, snatFor(svc))
			}
		})
	}
}

// TestResizeKeepsPendingInbound: a connection to a Service address that waits for its first
// reply (inbound_v4, inbound_v6) when --nat-max-entries changes is carried into the new tables
// with the flows: the pod's SYN-ACK after the resize still leaves untouched.
func TestResizeKeepsPendingInbound(t *testing.T) {
	root := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
	h := newHarness(t, nil, LoadOptions{})
	h.dp.Close()
	p := defaultPolicy(true)
	open := func(entries uint32) *Datapath {
		t.Helper()
		o, err := Open(root, OpenOptions{NATEntries: entries, Policy: p})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { o.Close() })
		if o.Migration != nil {
			if err := o.Migration.Finish(o.Datapath); err != nil {
				t.Fatal(err)
			}
		}
		if err := o.SyncPolicy(p); err != nil {
			t.Fatal(err)
		}
		for _, idx := range []int{testIfindex, h.ns.ifindex(t, "up0")} {
			if _, err := o.SetUplink(idx, Uplink{IPv4: snat4, IPv6: snat6}); err != nil {
				t.Fatal(err)
			}
		}
		return o.Datapath
	}
	// inbound tables of n/16 entries: 1<<15 makes them larger than the smallest (minSideEntries).
	h.dp = open(1 << 12)
	for _, fam := range families {
		h.t = t
		h.mustPass(h.dp.Ingress(), tcpSegment(ap(remote(fam.v6), 40000), ap(serviceAddr(fam.v6), 80), seg{flags: tcpSYN, seq: 100, win: 64240, wscale: 7}))
	}
	h.dp.Close()
	h.dp = open(1 << 15)
	if got := h.dp.objs.InboundV4.MaxEntries(); got != inboundEntries(1<<15) {
		t.Fatalf("inbound_v4 holds %d entries after the resize, want %d", got, inboundEntries(1<<15))
	}
	for _, fam := range families {
		synack := tcpSegment(ap(serviceAddr(fam.v6), 80), ap(remote(fam.v6), 40000), seg{flags: tcpSYN | tcpACK, seq: 900, ack: 101, win: 65160, wscale: 7})
		if ret, out := h.egress(synack); ret != tcNext || !bytes.Equal(out[:len(synack)], synack) {
			t.Fatalf("%s: the pod's SYN-ACK after the resize: verdict %d, changed %v, want it passed untouched",
				fam.name, int32(ret), !bytes.Equal(out[:len(synack)], synack))
		}
	}
}
