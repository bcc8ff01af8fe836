package cluster

import (
	"archive/tar"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/image"
)

// PauseRef is the sandbox image's reference: containerd's default name, so nothing else needs
// configuring, imported from the archive BuildPause writes and never pulled.
const PauseRef = "registry.k8s.io/pause:3.10"

// BuildPause builds the pause program (package pause beside this one) as a static binary and
// packs it as a one-file OCI image archive in dir, named PauseRef. It returns the archive.
func BuildPause(ctx context.Context, dir string) (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "pause")
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", bin, "./internal/cluster/pause")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build pause: %w: %s", err, strings.TrimSpace(string(out)))
	}
	rootfs := filepath.Join(dir, "pause-rootfs.tar")
	if err := oneFileTar(rootfs, bin, "pause"); err != nil {
		return "", err
	}
	out := filepath.Join(dir, "pause.tar")
	_, err = image.Pack(image.Options{
		Spec:    image.Spec{Suite: "none", Binary: "/pause", User: "65535:65535"},
		Version: "3.10", Reference: PauseRef, Epoch: time.Unix(0, 0), Output: out,
	}, rootfs)
	return out, err
}

// oneFileTar writes a tar holding the file src as name, executable.
func oneFileTar(out, src, name string) error {
	data, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o755, Size: int64(len(data)), Typeflag: tar.TypeReg, ModTime: time.Unix(0, 0)}); err != nil {
		return err
	}
	if _, err := tw.Write(data); err != nil {
		return err
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return f.Close()
}
