package bpf

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestIdleEstablishedKeptAsConntrackKeepsIt: under the default timeouts, an established TCP
// connection idle for 7 hours (past the 6 hours the datapath once kept it) is still in the
// table and translated both ways, as conntrack keeps one for 5 days; idle for longer than 5
// days, it is swept.
func TestIdleEstablishedKeptAsConntrackKeepsIt(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h.t = t
			podEnd, dst := ap(pod(fam.v6, 40), 4000), ap(remote(fam.v6), 443)
			nat := h.handshake(podEnd, dst)
			idle := func(ago time.Duration) {
				h.age(Egress, unix.IPPROTO_TCP, podEnd, dst, ago)
				h.age(Ingress, unix.IPPROTO_TCP, dst, nat, ago)
				if _, err := h.dp.Sweep(MonotonicNow(), DefaultTimeouts); err != nil {
					t.Fatal(err)
				}
			}
			idle(7 * time.Hour)
			if _, ok := h.entry(Egress, unix.IPPROTO_TCP, podEnd, dst); !ok {
				t.Fatal("an established connection idle for 7 hours was swept")
			}
			if got := tupleOf(t, h.mustPass(h.dp.Ingress(), tcpSegment(dst, nat, seg{flags: tcpACK, seq: 5001, ack: 1001, win: 502, wscale: -1}))).dst; got != podEnd {
				t.Fatalf("after 7 idle hours, a reply went to %s, want %s", got, podEnd)
			}
			if got := tupleOf(t, h.mustPass(h.dp.Egress(), tcpSegment(podEnd, dst, seg{flags: tcpACK, seq: 1001, ack: 5001, win: 502, wscale: -1}))).src; got != nat {
				t.Fatalf("after 7 idle hours, the connection left from %s, want %s", got, nat)
			}
			idle(5*24*time.Hour + time.Minute)
			if e, ok := h.entry(Egress, unix.IPPROTO_TCP, podEnd, dst); ok {
				t.Fatalf("an established connection idle for over 5 days is kept: %+v", e)
			}
		})
	}
}

// TestResolveTimeouts: each timeout is --nat-timeouts' where it sets one, else the node's
// conntrack sysctl (a positive number of seconds), else conntrack's default.
func TestResolveTimeouts(t *testing.T) {
	if DefaultTimeouts.TCPEstablished != 5*24*time.Hour || DefaultTimeouts.UDP != 2*time.Minute || DefaultTimeouts.Other != 10*time.Minute {
		t.Errorf("defaults %+v, want conntrack's (5 days established, 2 minutes UDP, 10 minutes generic)", DefaultTimeouts)
	}
	dir := t.TempDir()
	for name, v := range map[string]string{
		"nf_conntrack_tcp_timeout_established": "86400\n", "nf_conntrack_udp_timeout_stream": "45\n",
		"nf_conntrack_icmp_timeout": "0\n", "nf_conntrack_generic_timeout": "soon\n", "nf_conntrack_tcp_timeout_syn_sent": "60\n",
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, from := ResolveTimeouts(Timeouts{TCPOpening: 5 * time.Second}, dir)
	want := Timeouts{TCPEstablished: 24 * time.Hour, TCPOpening: 5 * time.Second, TCPClosing: 2 * time.Minute,
		UDP: 45 * time.Second, ICMP: 30 * time.Second, Other: 10 * time.Minute}
	wantFrom := map[string]string{"tcp-established": FromNode, "tcp-opening": FromFlag, "tcp-closing": FromConntrack,
		"udp": FromNode, "icmp": FromConntrack, "other": FromConntrack}
	if got != want {
		t.Errorf("timeouts %+v, want %+v", got, want)
	}
	for k, w := range wantFrom {
		if from[k] != w {
			t.Errorf("%s from %q, want %q", k, from[k], w)
		}
	}
	if got, _ := ResolveTimeouts(Timeouts{}, filepath.Join(dir, "none")); got != DefaultTimeouts {
		t.Errorf("without the nf_conntrack module: %+v, want conntrack's defaults", got)
	}
}
