// Command connrate measures the short-connection rate through a path: workers open a TCP
// connection, read one byte, and close, over and over, for a fixed time.
//
//	connrate serve -listen ADDR                  answer every connection with one byte, then close
//	connrate run -target ADDR -workers N -duration D   print one JSON result line
//
// The server closes first, so TIME_WAIT sits on the far side, as with most real services. A NAT
// that maps a pod socket onto an (address, port) pair the far side still holds in TIME_WAIT for
// another connection has its SYN rejected about half the time (timestamps are offset per
// connection, and PAWS rejects an older one): a bare ACK, the client's reset, and the SYN sent
// again. That is the cost this tool makes visible.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"slices"
	"sync"
	"syscall"
	"time"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "connrate:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return errors.New("usage: connrate serve|run [flags]")
	}
	fs := flag.NewFlagSet(args[0], flag.ContinueOnError)
	switch args[0] {
	case "serve":
		listen := fs.String("listen", ":7000", "address to listen on")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		return serve(ctx, *listen)
	case "run":
		target := fs.String("target", "", "server address")
		workers := fs.Int("workers", 32, "concurrent connections")
		duration := fs.Duration("duration", 5*time.Second, "how long to run")
		timeout := fs.Duration("timeout", 3*time.Second, "per-connection timeout; a connection that takes longer counts as an error")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		if *target == "" {
			return errors.New("run: -target is required")
		}
		res := load(ctx, *target, *workers, *duration, *timeout)
		return json.NewEncoder(os.Stdout).Encode(res)
	default:
		return fmt.Errorf("unknown command %q", args[0])
	}
}

func serve(ctx context.Context, addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	go func() { <-ctx.Done(); ln.Close() }()
	one := []byte{'x'}
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			// EMFILE and friends: back off briefly rather than spin.
			time.Sleep(time.Millisecond)
			continue
		}
		go func() {
			c.Write(one)
			c.Close()
		}()
	}
}

// Result is one run's outcome.
type Result struct {
	Connections int64   `json:"connections"`
	Errors      int64   `json:"errors"`
	Seconds     float64 `json:"seconds"`
	Rate        float64 `json:"rate"`
	// Latency percentiles of successful connections, in milliseconds (connect to close).
	P50ms float64 `json:"p50_ms"`
	P99ms float64 `json:"p99_ms"`
	// Slow counts connections that took over one second: a SYN that had to be retransmitted.
	Slow int64 `json:"slow"`
	// FirstError is the first failure seen, if any.
	FirstError string `json:"first_error,omitempty"`
}

func load(ctx context.Context, target string, workers int, duration, timeout time.Duration) Result {
	ctx, cancel := context.WithTimeout(ctx, duration)
	defer cancel()
	var mu sync.Mutex
	var res Result
	var lat []time.Duration
	start := time.Now()
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var local []time.Duration
			var conns, errs, slow int64
			var firstErr error
			buf := make([]byte, 1)
			d := net.Dialer{Timeout: timeout}
			for ctx.Err() == nil {
				t0 := time.Now()
				err := once(d, target, buf, timeout)
				if ctx.Err() != nil && err != nil {
					break // cut short by the end of the run: neither success nor failure
				}
				took := time.Since(t0)
				if err != nil {
					if firstErr == nil {
						firstErr = err
					}
					errs++
					continue
				}
				conns++
				if took > time.Second {
					slow++
				}
				local = append(local, took)
			}
			mu.Lock()
			res.Connections += conns
			res.Errors += errs
			res.Slow += slow
			if firstErr != nil && res.FirstError == "" {
				res.FirstError = firstErr.Error()
			}
			lat = append(lat, local...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	res.Seconds = time.Since(start).Seconds()
	res.Rate = float64(res.Connections) / res.Seconds
	if len(lat) > 0 {
		slices.Sort(lat)
		res.P50ms = float64(lat[len(lat)/2]) / float64(time.Millisecond)
		res.P99ms = float64(lat[len(lat)*99/100]) / float64(time.Millisecond)
	}
	return res
}

func once(d net.Dialer, target string, buf []byte, timeout time.Duration) error {
	c, err := d.Dial("tcp", target)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(timeout))
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	return nil
}
