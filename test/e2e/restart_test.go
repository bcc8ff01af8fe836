package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"strconv"
	"sync"
	"testing"
	"time"
)

// connratePort is where the external host's connrate server listens.
const connratePort = 7001

// TestRestartUnderTraffic: while 8 long TCP connections exchange a line every 20 ms and short
// connections churn (connrate: connect, read a byte, the server closes), the agent is killed
// with SIGKILL and started again 5 times. No exchange of a long connection fails or changes its
// source, and not one short connection fails. The external host has no route back to the pod,
// so every answer proves a translation.
func TestRestartUnderTraffic(t *testing.T) {
	const (
		long     = 8
		restarts = 5
		workers  = 1 // the churn need not take the machine: one worker opens thousands a second
	)
	eachBackend(t, backends(), nil, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		ag := env.StartReadyNoFile(ctx, t, b)
		StartLineEcho(t, env.Ext, []netip.Addr{public4})
		server := netip.AddrPortFrom(public4, connratePort)
		StartProcess(ctx, t, env.Ext, connrateBin, "serve", "-listen", server.String())
		WaitListening(ctx, t, env.Ext, server)
		env.CutReturnRoutes(ctx, t)

		// The long connections, each exchanging until stop.
		stop := make(chan struct{})
		var wg sync.WaitGroup
		var mu sync.Mutex
		var failures []string
		exchanges := make([]int, long)
		for i := range long {
			c, err := DialLine(ctx, env.Pod, netip.AddrPort{}, public4)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			first, err := c.Exchange("0")
			if err != nil || first.Addr() != NodeAddr4 {
				t.Fatalf("long connection %d: seen from %s (%v), want %s", i+1, first, err, NodeAddr4)
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				for n := 1; ; n++ {
					select {
					case <-stop:
						return
					case <-time.After(20 * time.Millisecond):
					}
					src, err := c.Exchange(strconv.Itoa(n))
					if err == nil && src != first {
						err = fmt.Errorf("seen from %s, before from %s", src, first)
					}
					mu.Lock()
					exchanges[i]++
					if err != nil {
						failures = append(failures, fmt.Sprintf("long connection %d, exchange %d at %s: %v", i+1, n, time.Now().Format("15:04:05.000"), err))
					}
					mu.Unlock()
					if err != nil {
						return
					}
				}
			}()
		}

		// The short connections run through all the restarts; SIGTERM ends the run and has
		// connrate print its result (the duration only bounds it: restarts take longer on a
		// slow machine, a kernel emulated in QEMU).
		synBefore := TCPExt(ctx, t, env.Pod, "TCPSynRetrans")
		churn := StartProcess(ctx, t, env.Pod, connrateBin, "run", "-target", server.String(),
			"-workers", strconv.Itoa(workers), "-duration", ScenarioTimeout.String())
		time.Sleep(time.Second)
		for i := range restarts {
			if err := ag.Kill(ctx); err != nil {
				t.Fatal(err)
			}
			t.Logf("restart %d: agent killed at %s", i+1, time.Now().Format("15:04:05.000"))
			time.Sleep(time.Duration(100*i) * time.Millisecond) // down for 0 to 400 ms
			ag = env.StartAgent(ctx, t, b)
			if err := ag.WaitReady(ctx); err != nil {
				t.Fatalf("restart %d: %v", i+1, err)
			}
			time.Sleep(300 * time.Millisecond)
		}
		time.Sleep(500 * time.Millisecond)
		if err := churn.Stop(ctx); err != nil {
			t.Fatalf("connrate: %v", err)
		}
		synRetrans := TCPExt(ctx, t, env.Pod, "TCPSynRetrans") - synBefore
		close(stop)
		wg.Wait()

		var res struct {
			Connections, Errors, Slow int64
			Rate                      float64
			FirstError                string `json:"first_error"`
		}
		if err := json.Unmarshal([]byte(churn.Logs()), &res); err != nil {
			t.Fatalf("connrate output %q: %v", churn.Logs(), err)
		}
		t.Logf("short connections: %d at %.0f/s, %d failed, %d SYNs sent again, %d over a second; long connections: %v exchanges",
			res.Connections, res.Rate, res.Errors, synRetrans, res.Slow, exchanges)
		if res.Errors != 0 {
			t.Errorf("%d short connections failed, the first: %s", res.Errors, res.FirstError)
		}
		if res.Connections < 1000 {
			t.Errorf("only %d short connections ran", res.Connections)
		}
		// A SYN sent again means a packet went untranslated or was dropped during a restart:
		// the pod's own count says so, where connrate's connections over a second also count
		// one that waited that long for a core on a loaded machine. iptables' --random-fully
		// has some anyway (a random port meeting the server's TIME_WAIT), so only the BPF
		// datapath is held to none.
		if b.NAT && synRetrans != 0 {
			t.Errorf("the pod sent %d SYNs again during the restarts (%d short connections took over a second)", synRetrans, res.Slow)
		}
		for _, f := range failures {
			t.Error(f)
		}
		for i, n := range exchanges {
			if n < 100 {
				t.Errorf("long connection %d made only %d exchanges", i+1, n)
			}
		}
		b.Verify(ctx, t, env)
	})
}
