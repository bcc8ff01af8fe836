package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// flowWatch keeps traffic going while a test changes the agent under it: every 20 ms each held
// flow exchanges a line (and must keep the source it started with), and every round a new TCP
// connection to the external host's echo server must be masqueraded. With the external host's
// routes to the pods cut, every answer proves a translation.
type flowWatch struct {
	stopc chan struct{}
	wg    sync.WaitGroup

	mu       sync.Mutex
	failures []string
	rounds   int
}

// heldFlows opens a TCP connection and a UDP flow from the pod to the line echo server at dst
// and returns them with the source the server saw for each (the node's address, masqueraded).
func heldFlows(ctx context.Context, t *testing.T, env *Env, dst netip.Addr) ([]*Conn, []netip.AddrPort) {
	t.Helper()
	tcp, err := DialLine(ctx, env.Pod, netip.AddrPort{}, dst)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tcp.Close() })
	udp, err := DialLineUDP(ctx, env.Pod, netip.AddrPort{}, dst)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { udp.Close() })
	conns := []*Conn{tcp, udp}
	var seen []netip.AddrPort
	for i, c := range conns {
		src, err := c.Exchange("hello")
		if err != nil || src.Addr() != NodeAddr(policy.FamilyOf(dst)) {
			t.Fatalf("held flow %d: seen from %s (%v), want the node's address", i, src, err)
		}
		seen = append(seen, src)
	}
	return conns, seen
}

// watchFlows starts the traffic; conns must answer from seen.
func watchFlows(ctx context.Context, env *Env, conns []*Conn, seen []netip.AddrPort) *flowWatch {
	w := &flowWatch{stopc: make(chan struct{})}
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		for n := 0; ; n++ {
			select {
			case <-w.stopc:
				return
			case <-time.After(20 * time.Millisecond):
			}
			at := time.Now().Format("15:04:05.000")
			var fails []string
			for i, c := range conns {
				src, err := c.Exchange(strconv.Itoa(n))
				if err == nil && src != seen[i] {
					err = fmt.Errorf("seen from %s, before from %s", src, seen[i])
				}
				if err != nil {
					fails = append(fails, fmt.Sprintf("%s: held flow %d (%s), exchange %d: %v", at, i, c.Local(), n, err))
				}
			}
			if got, src, err := env.Observe(ctx, "tcp", public4); err != nil || got != Masq {
				fails = append(fails, fmt.Sprintf("%s: a new connection: seen from %s (%s), %v", at, src, got, err))
			}
			w.mu.Lock()
			w.rounds++
			w.failures = append(w.failures, fails...)
			w.mu.Unlock()
		}
	}()
	return w
}

// stop ends the traffic and fails the test for every failed exchange or probe; fewer than
// minRounds rounds is a failure too (the watch would prove nothing).
func (w *flowWatch) stop(t *testing.T, minRounds int) {
	t.Helper()
	close(w.stopc)
	w.wg.Wait()
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, f := range w.failures {
		t.Error(f)
	}
	if w.rounds < minRounds {
		t.Errorf("only %d rounds of traffic ran, want %d", w.rounds, minRounds)
	}
	t.Logf("%d rounds of traffic, %d failures", w.rounds, len(w.failures))
}
