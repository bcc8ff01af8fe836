package bpfbackend

import (
	"context"
	"log/slog"
	"net/netip"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
)

// TestSweepLoop: the backend's sweep removes idle flows on its own, and the NAT metrics count
// them by protocol. The backend is assembled by hand (New would follow the host's uplinks); the
// flows are made with BPF_PROG_TEST_RUN, which sends nothing.
func TestSweepLoop(t *testing.T) {
	bpffs := testutil.MountBPFFS(t)
	dp := loadPinned(t, bpffs, compile(t, "", false))
	node := netip.MustParseAddr("192.0.2.1")
	if _, err := dp.SetUplink(1, bpf.Uplink{IPv4: node}); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		src := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, 0, byte(10 + i)}), 1000)
		run(t, dp.Egress(), udp(t, src, netip.MustParseAddrPort("198.51.100.7:53")))
	}
	b := &Backend{log: slog.New(slog.DiscardHandler), opts: Options{SweepInterval: 20 * time.Millisecond,
		Timeouts: bpf.Timeouts{TCPEstablished: time.Hour, TCPOpening: time.Hour, TCPClosing: time.Hour,
			UDP: 200 * time.Millisecond, ICMP: time.Hour, Other: time.Hour}}}
	b.dp.Store(dp)
	st, err := b.NATStats(context.Background())
	if err != nil || len(st.Entries) != 1 || st.Entries[0].Entries != 6 || st.Swept["udp"] != 0 {
		t.Fatalf("before the sweep: %+v %v", st, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		b.sweepLoop(ctx)
	}()
	defer func() {
		cancel()
		<-done
	}()
	deadline := time.Now().Add(5 * time.Second)
	for {
		st, err = b.NATStats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if len(st.Entries) == 0 && st.Swept["udp"] == 6 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the sweep did not remove the idle flows: %+v", st)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
