package image

import (
	"archive/tar"
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"
	"time"

	v1 "github.com/opencontainers/image-spec/specs-go/v1"
)

// Entry is one file, directory or symbolic link of a layer WriteLayer makes.
type Entry struct {
	// Path is where it is in the image, absolute ("/agnhost").
	Path string
	// Source is the file of this machine it copies; empty for a directory or a link.
	Source string
	// Link makes it a symbolic link to this target.
	Link string
	// Mode is its permission bits; zero means 0o755 for a directory and 0o644 for a file.
	Mode fs.FileMode
}

// WriteLayer writes a layer (a tar, for Pack) of the entries, in their order, every one owned by
// root and stamped epoch: what a Dockerfile's ADD, RUN mkdir and RUN ln -s would lay over a root
// filesystem. A directory an entry is in must exist below it or be an earlier entry.
func WriteLayer(out string, epoch time.Time, entries []Entry) error {
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	defer f.Close()
	w := bufio.NewWriterSize(f, 1<<20)
	tw := tar.NewWriter(w)
	for _, e := range entries {
		if err := writeEntry(tw, epoch.UTC(), e); err != nil {
			return fmt.Errorf("layer %s: %s: %w", out, e.Path, err)
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	if err := w.Flush(); err != nil {
		return err
	}
	return f.Close()
}

func writeEntry(tw *tar.Writer, epoch time.Time, e Entry) error {
	if !path.IsAbs(e.Path) || path.Clean(e.Path) != e.Path || e.Path == "/" {
		return fmt.Errorf("not a clean absolute path")
	}
	h := &tar.Header{Name: strings.TrimPrefix(e.Path, "/"), ModTime: epoch, Format: tar.FormatPAX, Mode: int64(e.Mode.Perm())}
	switch {
	case e.Link != "" && e.Source != "":
		return fmt.Errorf("both a link and a source")
	case e.Link != "":
		h.Typeflag, h.Linkname, h.Mode = tar.TypeSymlink, e.Link, 0o777
		return tw.WriteHeader(h)
	case e.Source == "":
		h.Typeflag, h.Name = tar.TypeDir, h.Name+"/"
		if h.Mode == 0 {
			h.Mode = 0o755
		}
		return tw.WriteHeader(h)
	}
	src, err := os.Open(e.Source)
	if err != nil {
		return err
	}
	defer src.Close()
	st, err := src.Stat()
	if err != nil {
		return err
	}
	if !st.Mode().IsRegular() {
		return fmt.Errorf("%s is not a regular file", e.Source)
	}
	h.Typeflag, h.Size = tar.TypeReg, st.Size()
	if h.Mode == 0 {
		h.Mode = 0o644
	}
	if err := tw.WriteHeader(h); err != nil {
		return err
	}
	_, err = io.Copy(tw, src)
	return err
}

// Retag copies the OCI archive src (one image, as Pack writes it) to dst under another
// reference: the same manifest, configuration and layers, so the same image ID, imported under
// a second name.
func Retag(src, dst, reference string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	defer out.Close()
	w := bufio.NewWriterSize(out, 1<<20)
	tw := tar.NewWriter(w)
	tr := tar.NewReader(in)
	renamed := false
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("%s: %w", src, err)
		}
		if h.Name != "index.json" {
			if err := tw.WriteHeader(h); err != nil {
				return err
			}
			if _, err := io.Copy(tw, tr); err != nil {
				return err
			}
			continue
		}
		index, err := renameIndex(tr, reference)
		if err != nil {
			return fmt.Errorf("%s: index.json: %w", src, err)
		}
		h.Size = int64(len(index))
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if _, err := tw.Write(index); err != nil {
			return err
		}
		renamed = true
	}
	if !renamed {
		return fmt.Errorf("%s holds no index.json", src)
	}
	if err := tw.Close(); err != nil {
		return err
	}
	if err := w.Flush(); err != nil {
		return err
	}
	return out.Close()
}

// renameIndex reads an OCI index of one manifest and returns it naming the manifest reference.
func renameIndex(r io.Reader, reference string) ([]byte, error) {
	var index v1.Index
	if err := json.NewDecoder(r).Decode(&index); err != nil {
		return nil, err
	}
	if len(index.Manifests) != 1 {
		return nil, fmt.Errorf("%d manifests, want 1", len(index.Manifests))
	}
	index.Manifests[0].Annotations = refAnnotations(reference)
	return json.Marshal(index)
}
