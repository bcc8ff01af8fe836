// Command mkimage builds the agent's runtime image (package image) as an OCI archive: what
// `make image` runs before loading it into podman.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/image"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "mkimage:", err)
		os.Exit(1)
	}
}

func run() error {
	bin := flag.String("bin", "bin/ip-masq-agent", "the agent binary to install")
	out := flag.String("out", "bin/ip-masq-agent-image.tar", "the OCI archive to write")
	version := flag.String("version", "", "the release version (the VERSION file)")
	ref := flag.String("ref", "", "the image reference (default "+image.Repository+":VERSION)")
	flag.Parse()
	if *version == "" {
		return fmt.Errorf("-version is required")
	}
	if *ref == "" {
		*ref = image.Repository + ":" + *version
	}
	sde := os.Getenv("SOURCE_DATE_EPOCH")
	if sde == "" {
		return fmt.Errorf("SOURCE_DATE_EPOCH is not set (make image sets it to the last commit's time)")
	}
	secs, err := strconv.ParseInt(strings.TrimSpace(sde), 10, 64)
	if err != nil {
		return fmt.Errorf("SOURCE_DATE_EPOCH=%q: %w", sde, err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	res, err := image.Build(ctx, image.Options{Spec: image.Runtime, Binary: *bin, Version: *version, Reference: *ref,
		Epoch: time.Unix(secs, 0), Output: *out, Log: os.Stderr})
	if err != nil {
		return err
	}
	fmt.Printf("%s: %s\n  manifest %s\n  image id %s\n  root filesystem %.1f MB, built in %.0f s\n",
		*out, *ref, res.Manifest, res.Config, float64(res.LayerSize)/1e6, time.Since(start).Seconds())
	return nil
}
